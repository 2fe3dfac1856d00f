#!/usr/bin/env bash
# The GPU check, on any machine with a CUDA GPU, from a checkout with `pip install -e ".[gpu,test]"` done:
#   pytest tests/gpu, then the serving checks (orchestrate.py: plain, dflash and dflash_adaptive served by dflash-serve
#   on the bundled tiny pair and an 8B-shaped random pair); report.json and the logs under --out.
# Usage: scripts/gpu-check/run.sh [--out DIR] [--offline DIR] [--torch-kernels] [--no-jit] [--no-pytest]
#                                 [--time-limit S] [--dry-run] [orchestrate.py's --only NAME,NAME --serial]
#   --out DIR        report.json, pytest.log, checks.log and work/ (the servers' logs); default gpu-check-out
#   --offline DIR    first install what stage.py put in DIR, then dflash-serve from the tree, with no network
#   --torch-kernels  test-only: SGLang's CUDA path without sgl-kernel and FlashInfer (check_hook.py); no pytest
#   --no-jit         no nvcc build of SGLang's JIT kernels: their torch fallbacks only
#   --no-pytest      the serving checks only
#   --time-limit S   seconds for the serving checks together (default: none; each has its own timeout)
#   --dry-run        no install, no GPU: the orchestration with stand-in checks (tests/unit/test_gpu_check.py)
# Exits 0 when tests/gpu and every serving check passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
HERE=scripts/gpu-check
PY=${PYTHON:-python3}
out=gpu-check-out offline='' torch_kernels=0 dry=0 pytest=1 limit=() pass=()
while (($#)); do
  case "$1" in
    --out) out=${2:?--out needs a folder}; shift ;;
    --offline) offline=${2:?--offline needs the folder stage.py filled}; shift ;;
    --torch-kernels) torch_kernels=1 ;;
    --no-jit) export DFLASH_SERVE_GPU_CHECK_NO_JIT=1 ;;
    --no-pytest) pytest=0 ;;
    --time-limit) limit=(--time-limit "${2:?--time-limit needs seconds}"); shift ;;
    --dry-run) dry=1 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) pass+=("$1") ;;
  esac
  shift
done
mkdir -p "$out"
log() { echo "[gpu-check $(date -u +%H:%M:%S)] $*"; }

if ((dry)); then
  log "dry run: no install, stand-in checks"
  exec "$PY" "$HERE/orchestrate.py" --dry-run --out "$out" "${limit[@]}" "${pass[@]}"
fi

if [[ -n $offline ]]; then
  [[ -f $offline/stage.json ]] || { log "no $offline/stage.json: fill the folder with $HERE/stage.py"; exit 2; }
  no_deps=$("$PY" -c 'import json, sys; print(int(json.load(open(sys.argv[1]))["no_deps"]))' "$offline/stage.json")
  shopt -s nullglob
  wheels=("$offline"/*.whl)
  shopt -u nullglob
  deps=()
  ((no_deps)) && deps=(--no-deps)
  if ((${#wheels[@]})); then
    log "installing ${#wheels[@]} wheels from $offline"
    "$PY" -m pip install -q --no-index --find-links "$offline" "${deps[@]}" "${wheels[@]}" 2>&1 | tee "$out/install.log"
    ((PIPESTATUS[0] == 0)) || { log "the install failed: $out/install.log"; exit 1; }
  fi
  if ((no_deps)) && ! missing=$("$PY" "$HERE/stage.py" --verify-installed); then
    log "manifest pins not installed (stage again with --have, or install them):"
    echo "$missing"
    exit 1
  fi
  log "installing dflash-serve from the tree (no network)"
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation . 2>&1 | tee -a "$out/install.log"
  ((PIPESTATUS[0] == 0)) || { log "the dflash-serve install failed: $out/install.log"; exit 1; }
fi

"$PY" - <<'EOF' || exit 1
import sys
from importlib import metadata

try:
    metadata.version("dflash-serve")
except metadata.PackageNotFoundError:
    sys.exit('[gpu-check] dflash-serve is not installed: pip install -e ".[gpu,test]" (or run.sh --offline DIR)')
import torch

if not torch.cuda.is_available():
    sys.exit(f"[gpu-check] torch {torch.__version__} sees no CUDA GPU")
print(f"[gpu-check] {torch.cuda.get_device_name(0)}; torch {torch.__version__}; sglang {metadata.version('sglang')}")
EOF

status=0
if ((pytest && torch_kernels)); then
  log "tests/gpu skipped: --torch-kernels has no sgl-kernel or FlashInfer for it"
elif ((pytest)); then
  log "pytest tests/gpu"
  "$PY" -m pytest tests/gpu -q -rs 2>&1 | tee "$out/pytest.log"
  ((PIPESTATUS[0] == 0)) || status=1
fi

# The hook lives in site-packages only for this run: every process the checks start applies it before SGLang loads.
site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
hook="$site/$(cd "$HERE" && "$PY" -c 'import check_hook as m; print(m.HOOK_FILE)')"
(cd "$HERE" && "$PY" -c 'import check_hook as m, sys; sys.stdout.write(m.HOOK_LINE)') >"$hook" \
  || { log "cannot write $hook (run from a virtual environment you own)"; exit 1; }
trap 'rm -f "$hook"' EXIT
mode=observe
((torch_kernels)) && mode=torch-kernels
export DFLASH_SERVE_GPU_CHECK=$mode PYTHONUNBUFFERED=1
"$PY" -c 'import sys; h = sys.modules["check_hook"]; assert h.mode() == "observe" or "chain_sampler" in h.install()' \
  || { log "the start-up hook did not apply (its error is above): $hook"; exit 1; }
log "serving checks ($mode)"
"$PY" "$HERE/orchestrate.py" --out "$out" "${limit[@]}" "${pass[@]}" 2>&1 | tee "$out/checks.log"
((PIPESTATUS[0] == 0)) || status=1
log "report: $out/report.json"
exit "$status"
