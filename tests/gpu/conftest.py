"""GPU suite: `DFLASH_GPU_TARGET=/models/Qwen/Qwen3-8B DFLASH_GPU_DRAFTER=/models/z-lab/Qwen3-8B-DFlash-b16
python3 -m pytest tests/gpu -s` on a machine with one CUDA GPU. Skipped everywhere else (CI is CPU-only). The
kernel-level tests (test_tree_gpu.py) need no model pair: `python3 -m pytest tests/gpu/test_tree_gpu.py` on any CUDA
GPU."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def _why_skip(needs_pair: bool) -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    missing = [v for v in ("DFLASH_GPU_TARGET", "DFLASH_GPU_DRAFTER") if not os.environ.get(v)]
    if needs_pair and missing:
        return f"set {' and '.join(missing)} to a target / DFlash drafter directory"
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.gpu)
            # the serving tests need a model pair; the kernel-level tests (test_tree_gpu.py) only a GPU
            reason = _why_skip(needs_pair="gpu_config" in getattr(item, "fixturenames", ()))
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def gpu_config() -> dict:
    """deploy/configs/gpu-qwen3-8b.yaml pointed at the pair from the environment, bound to loopback."""
    cfg = yaml.safe_load((REPO / "deploy/configs/gpu-qwen3-8b.yaml").read_text())
    cfg["model"]["path"] = os.environ["DFLASH_GPU_TARGET"]
    cfg["model"]["dtype"] = os.environ.get("DFLASH_GPU_DTYPE", cfg["model"].get("dtype", "bfloat16"))
    cfg["server"] |= {"host": "127.0.0.1", "api_key_env": None, "max_running_requests": 64}
    cfg["speculative"] = {"algorithm": "dflash_adaptive", "draft_model_path": os.environ["DFLASH_GPU_DRAFTER"]}
    return cfg
