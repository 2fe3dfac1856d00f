#!/usr/bin/env bash
# The GPU kit's device step, run ON the GPU machine from the repository root:
#   install the staged wheels (.gpukit/part*/, carried) into the device's python3, install dflash-serve from the
#   tree, put the test-only mode's start-up hook in place, run orchestrate.py; report.json + logs under $OUT.
# Usage: scripts/gpu-kit/run.sh [--install-only] [--dry-run] [--no-jit] [--budget S] [orchestrate.py: --only A,B --serial]
#   --install-only  install the parts this transfer brought and stop (the first transfer of a split kit, README.md)
#   --dry-run       no install, no GPU: the checks' orchestration with stand-ins (rehearsal, tests/unit)
#   --no-jit        no nvcc build of SGLang's JIT kernels: their torch fallbacks only (gpu_kit_test_only.py)
# Everything is bounded: the checks get --budget seconds (default 480) after the install, each its own timeout.
set -uo pipefail
cd "$(dirname "$0")/../.."
KIT=scripts/gpu-kit
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu-kit-out}
mkdir -p "$OUT"
install_only=0 dry=0 budget=480 pass=()
while (($#)); do
  case "$1" in
    --install-only) install_only=1 ;;
    --dry-run) dry=1 ;;
    --no-jit) export GPU_KIT_NO_JIT=1 ;;
    --budget) budget=${2:?--budget needs seconds}; shift ;;
    --budget=*) budget=${1#--budget=} ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) pass+=("$1") ;;
  esac
  shift
done
[[ $budget =~ ^[0-9]+$ ]] || { echo "run.sh: --budget must be whole seconds, not '$budget'" >&2; exit 2; }

log() { echo "[gpu-kit $(date -u +%H:%M:%S)] $*"; }

if ((dry)); then
  log "dry run: no install, stand-in checks"
  exec "$PY" "$KIT/orchestrate.py" --dry-run --out "$OUT" --budget "$budget" "${pass[@]}"
fi

shopt -s nullglob
wheels=(.gpukit/part*/*.whl)
if ((${#wheels[@]})); then
  log "installing ${#wheels[@]} staged wheels into $("$PY" -c 'import sys; print(sys.executable)')"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
    "${wheels[@]}" 2>&1 | tee -a "$OUT/install.log" || { log "wheel install failed: $OUT/install.log"; exit 1; }
fi
if ((install_only)); then
  log "install-only: done (the next transfer brings the next part and runs the checks)"
  exit 0
fi
missing=$("$PY" "$KIT/stage.py" --verify-installed)
if (($?)); then
  log "manifest pins not installed (copy every .gpukit/part* first, README.md):"; echo "$missing"
  printf '{"schema": 1, "error": "staged wheels missing", "missing": %s}\n' \
    "$("$PY" -c 'import json,sys; print(json.dumps(sys.stdin.read().split("\n")))' <<<"$missing")" >"$OUT/report.json"
  exit 1
fi
# every run: the tree may have changed since the last one (a fix between the run and its rerun)
log "installing dflash-serve from the tree (hatchling, no network)"
"$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --disable-pip-version-check . \
  2>&1 | tee -a "$OUT/install.log" || { log "dflash-serve install failed: $OUT/install.log"; exit 1; }
site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
hook=$(cd "$KIT" && "$PY" -c 'import gpu_kit_test_only as m; print(m.HOOK_FILE)')
(cd "$KIT" && "$PY" -c 'import gpu_kit_test_only as m, sys; sys.stdout.write(m.HOOK_LINE)') >"$site/$hook"
log "test-only mode hook: $site/$hook"
export DFLASH_SERVE_GPU_KIT_TEST_ONLY=1 PYTHONUNBUFFERED=1
"$PY" -c 'import sys; assert "sgl_kernel" in sys.modules, "the kit hook did not run"; print("[gpu-kit] hook active")' \
  || { log "the test-only hook is not active: check $site/$hook"; exit 1; }
log "checks (budget ${budget}s)"
"$PY" "$KIT/orchestrate.py" --out "$OUT" --budget "$budget" "${pass[@]}" 2>&1 | tee "$OUT/checks.log"
exit "${PIPESTATUS[0]}"
