"""Rehearse the device's import path HERE, without a GPU: SGLang's CUDA branches under the kit's test-only mode.

Run by the kit's Python 3.12 venv (scripts/gpu-kit/README.md "Rehearsed here"), never by CI (that venv needs the
staged wheels and PyTorch 2.11 with its CUDA libraries, ~2.5 GB):

    DFLASH_SERVE_GPU_KIT_TEST_ONLY=1 PYTHONPATH=$REPO /tmp/kitvenv/bin/python scripts/gpu-kit/rehearse.py

torch is told a Hopper GPU is there (no kernel runs), so every module-level `if is_cuda():` import SGLang makes on
the device is made here; then the server arguments of each algorithm are resolved, as the scheduler would, to show
the backends the mode selects. Prints one line per module and exits non-zero on any failure.
"""
from __future__ import annotations

import importlib
import sys
import traceback
from pathlib import Path

import torch

KIT = Path(__file__).resolve().parent
REPO = KIT.parents[1]
sys.path[:0] = [str(REPO), str(KIT)]

SERVING_PATH = [
    "sglang.srt.server_args", "sglang.srt.entrypoints.http_server", "sglang.srt.managers.scheduler",
    "sglang.srt.managers.tokenizer_manager", "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner", "sglang.srt.model_executor.runner.decode_cuda_graph_runner",
    "sglang.srt.speculative.dflash_worker_v2", "sglang.srt.speculative.dflash_utils", "sglang.srt.models.qwen3",
    "sglang.srt.models.dflash", "sglang.srt.layers.attention.triton_backend", "sglang.srt.layers.sampler",
    "sglang.srt.layers.layernorm", "sglang.srt.layers.activation", "sglang.srt.layers.rotary_embedding",
    "sglang.kernels.ops.speculative.verify_sampling", "sglang.kernels.ops.sampling.renorm",
    "sglang_ext.plugin", "sglang_ext.worker", "sglang_ext.verify_runtimes", "service.server_entry",
]


class _H100Properties:
    major, minor, name, total_memory, multi_processor_count = 9, 0, "NVIDIA H100 80GB HBM3", 80 * 2**30, 132


def pretend_cuda() -> None:
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_name = lambda *a, **k: _H100Properties.name
    torch.cuda.get_device_properties = lambda *a, **k: _H100Properties()
    torch.cuda.mem_get_info = lambda *a, **k: (70 * 2**30, 80 * 2**30)


def main() -> int:
    if torch.version.cuda is None:
        print("rehearse.py needs a CUDA build of torch (the device's 2.11), not a CPU build")
        return 2
    pretend_cuda()
    import gpu_kit_test_only as mode

    applied = mode.install()
    if not applied:
        print(f"set {mode.names.GPU_KIT_TEST_ONLY}=1: the mode is inert without it")
        return 2
    print("mode:", ", ".join(applied))
    failures = 0
    for name in SERVING_PATH:
        try:
            importlib.import_module(name)
            print("ok  ", name)
        except BaseException as e:  # noqa: BLE001 -- every failure is listed
            failures += 1
            print("FAIL", name, f"{type(e).__name__}: {str(e)[:300]}")
            traceback.print_exc(limit=-3)
    from sglang.srt.server_args import prepare_server_args

    import sglang_ext.plugin

    sglang_ext.plugin.register()
    pair = REPO / "models/tiny-code"
    for algorithm in (None, "DFLASH", "DFLASH_ADAPTIVE"):
        argv = ["--model-path", str(pair / "target"), "--device", "cuda", "--dtype", "float32"]
        if algorithm:
            argv += ["--speculative-algorithm", algorithm, "--speculative-draft-model-path", str(pair / "drafter")]
        try:
            args = prepare_server_args(argv)
            args.resolve_once()
            print(f"args {algorithm or 'plain'}: attention {args.attention_backend}, draft attention "
                  f"{args.speculative_draft_attention_backend}, sampling {args.sampling_backend}")
        except BaseException as e:  # noqa: BLE001
            failures += 1
            print(f"FAIL args {algorithm}: {type(e).__name__}: {str(e)[:300]}")
    import sglang.srt.speculative.dflash_utils as du

    stand_ins = {"verify sampler": du.tree_speculative_sampling_target_only.__module__,
                 "top-k renorm": du.top_k_renorm_prob, "top-p renorm": du.top_p_renorm_prob}
    print("DFlash sampling verify:", stand_ins)
    if stand_ins != {"verify sampler": "sglang_ext.cpu.sampling", "top-k renorm": None, "top-p renorm": None}:
        failures += 1
    print("sgl_kernel modules imported:", sorted(m for m in sys.modules if m.startswith("sgl_kernel")))
    print(f"{failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
