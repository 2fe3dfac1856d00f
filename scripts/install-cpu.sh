#!/usr/bin/env bash
# Install dflash-serve for CPU serving into the current Python (use a venv if you like).
# Idempotent: re-running installs nothing that is already satisfied.
#   torch 2.13.0 CPU build -> sglang 0.5.23 without its GPU dependencies -> its pure-Python
#   dependencies at pinned versions -> this package (editable) -> the tiny test model pair.
# Usage: scripts/install-cpu.sh [--test]   (--test adds the test dependencies)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip() { "$PY" -m pip install --disable-pip-version-check --no-input -q "$@"; }

echo "[install] torch 2.13.0 (CPU build)"
pip torch==2.13.0
echo "[install] sglang 0.5.23 (no GPU dependencies)"
pip --no-deps sglang==0.5.23
echo "[install] SGLang's pure-Python dependencies (pinned)"
pip -c requirements/constraints-cpu.txt -r requirements/cpu.txt
if [[ "${1:-}" == "--test" ]]; then
  echo "[install] test dependencies"
  pip -c requirements/constraints-cpu.txt -r requirements/test.txt
  # Prometheus + promtool and Alertmanager (+ amtool) for tests/deploy, from Debian's packages. As root (CI) a
  # failure is fatal; otherwise it needs passwordless sudo, and without it the deploy tests skip, saying so. In a
  # container the packages' services are not started; on a systemd host they are (`systemctl disable --now
  # prometheus prometheus-alertmanager` if unwanted).
  if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null \
      || ! command -v prometheus-alertmanager >/dev/null; then
    apt_install() {
      "$@" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus \
        prometheus-alertmanager >/dev/null \
        || { "$@" apt-get update -qq && "$@" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
             --no-install-recommends prometheus prometheus-alertmanager >/dev/null; }
    }
    if ! command -v apt-get >/dev/null; then
      echo "[install] warning: no apt-get here; install prometheus, promtool and alertmanager for tests/deploy" >&2
    elif [[ $(id -u) -eq 0 ]]; then
      echo "[install] prometheus, prometheus-alertmanager (Debian packages, for tests/deploy)"
      apt_install
    elif sudo -n true 2>/dev/null; then
      echo "[install] prometheus, prometheus-alertmanager (Debian packages via sudo, for tests/deploy)"
      apt_install sudo -n
    else
      echo "[install] warning: not root and no passwordless sudo; run 'apt-get install prometheus prometheus-alertmanager' for tests/deploy" >&2
    fi
  fi
  # kubectl >= 1.27 (kustomize v5 built in) renders deploy/k8s for tests/deploy/test_k8s.py. No PyPI or Debian
  # package installs one (Debian's kubernetes-client is 1.20), so it is not installed here: said loudly instead, and in
  # CI (CI=true) those tests fail without it rather than skip.
  kubectl_version=$(kubectl version --client 2>/dev/null | sed -n 's/.*v\([0-9]*\)\.\([0-9]*\)\..*/\1 \2/p' | head -1 || true)
  found=${kubectl_version/ /.}
  if [[ -z "$kubectl_version" ]] || (( ${kubectl_version% *} == 1 && ${kubectl_version#* } < 27 )); then
    echo "[install] WARNING: no kubectl >= 1.27 on PATH (found: ${found:-none}); install it" \
         "(https://kubernetes.io/docs/tasks/tools/) or tests/deploy/test_k8s.py skips, and fails under CI=true" >&2
  fi
fi
# timm (an optional sglang import) drags in a CUDA torchvision; the CPU layer stubs torchvision instead.
"$PY" -m pip uninstall -y -q torchvision 2>/dev/null || true
echo "[install] dflash-serve (editable)"
pip --no-deps -e .
if [[ ! -f models/tiny-random/drafter/model.safetensors ]]; then
  echo "[install] creating the tiny test model pair in models/tiny-random"
  "$PY" -m dflash_models.tiny models/tiny-random
fi
"$PY" - <<'PY'
import importlib.metadata as md, torch
assert torch.__version__.startswith("2.13.0"), f"torch {torch.__version__}: expected the 2.13.0 CPU build"
eps = [e.value for e in md.entry_points(group="sglang.srt.plugins") if e.name == "dflash_serve"]
assert eps == ["sglang_ext.plugin:register"], f"plugin entry point missing: {eps}"
print(f"[install] ok: torch {torch.__version__}, sglang {md.version('sglang')}, plugin {eps[0]}")
PY
