"""The GPU check's start-up hook: what every process of a check run applies before SGLang's module-level imports.

run.sh writes `HOOK_FILE` into the interpreter's site-packages for the length of a run (and removes it after) and
sets `VAR` for the processes it starts; without the variable the hook does nothing, and the wheel ships neither.

`VAR=observe` (every run) only logs what the report reads from the server logs: each JIT kernel SGLang builds
(`JIT_LOG_MARK`; a failed build is remembered, not retried on every forward) and the first replay of every decode
CUDA graph runner (`REPLAY_LOG_MARK`, with its verify width).

`VAR=torch-kernels` (run.sh --torch-kernels) also serves SGLang's CUDA path on a GPU machine that has no sgl-kernel
and no FlashInfer, as a test-only mode, never a serving one. What it replaces, and nothing else, so the rest of
SGLang's GPU path (scheduler, DFlash worker, our worker, CUDA graphs, Triton attention and verify kernels) is the
real one:
  * `sgl_kernel` imports: the CPU layer's import stub (sglang_ext/cpu/stubs.py); a stub op that is called raises
    naming itself, so a gap is a recorded failure, never garbage;
  * fused ops (RMSNorm, SiLU-and-mul, rotary, ...): SGLang's own pure-torch `forward_native`, through upstream's
    `SGLANG_FORCE_FUSED_OP_BACKEND`;
  * DFlash's sampling verify, whose CUDA kernel is JIT-built against FlashInfer's headers: the CPU layer's torch
    chain sampler (sglang_ext/cpu/sampling.py), which is device-agnostic; its top-k / top-p renormalisation,
    FlashInfer's on CUDA: dflash_utils' own torch fallback;
  * backends: Triton attention (target and draft) and the pytorch sampling backend, where the config leaves them
    unset.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # the hook runs before the repository is on sys.path in SGLang's children
    sys.path.append(str(REPO))

logger = logging.getLogger(__name__)

VAR = "DFLASH_SERVE_GPU_CHECK"
OBSERVE, TORCH_KERNELS = "observe", "torch-kernels"
HOOK_FILE = "dflash_serve_gpu_check.pth"
# One line, as site.py runs it: a .pth line cannot span statements, and the module is found through its folder.
HOOK_LINE = (f'import os, sys; os.environ.get("{VAR}") in ("{OBSERVE}", "{TORCH_KERNELS}") and '
             f'(sys.path.append({str(Path(__file__).resolve().parent)!r}) or '
             f'__import__("check_hook").install())\n')

# upstream switches: every fused op on its pure-torch forward; no version check of the absent sgl-kernel wheel
UPSTREAM_ENV = {
    "SGLANG_FORCE_FUSED_OP_BACKEND": "torch",
    "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1",
}
# server-args defaults under the mode: backends that need neither FlashInfer nor sgl-kernel
BACKENDS = {
    "attention_backend": "triton",
    "speculative_draft_attention_backend": "triton",
    "sampling_backend": "pytorch",
}
JIT_LOG_MARK = "gpu-check: JIT kernel requested:"
NO_JIT_VAR = "DFLASH_SERVE_GPU_CHECK_NO_JIT"  # '1': no nvcc build at all (see _log_jit)
REPLAY_LOG_MARK = "gpu-check: CUDA graph replayed: tokens per request"
# sgl_kernel functions the CUDA path calls outside the fused ops, as torch-native stand-ins
STUB_OPS = {
    # triton_backend.py asks whether to launch with programmatic dependent launch; without sgl-kernel, never
    "is_arch_support_pdl": lambda *args, **kwargs: False,
}

# submodules that must stay missing: SGLang's `except ImportError` fallback is the torch path
KEEP_MISSING = frozenset({"sgl_kernel.scalar_type"})

_installed: list[str] = []


class _SglKernelSubmodules(frozenset):
    """Every `sgl_kernel.*` name but KEEP_MISSING, as the names the CPU layer's stub finder serves."""

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.startswith("sgl_kernel.") and name not in KEEP_MISSING


def mode() -> str | None:
    value = os.environ.get(VAR)
    return value if value in (OBSERVE, TORCH_KERNELS) else None


def install() -> list[str]:
    """Apply the hook in this process when its variable is set; return what was applied (empty: inert)."""
    if mode() is None:
        return []
    if _installed:
        return list(_installed)
    from sglang_ext.patches.wrap import when_imported

    when_imported("sglang.kernels.jit.utils", _log_jit)
    when_imported("sglang.srt.model_executor.runner.decode_cuda_graph_runner", _log_first_replay)
    _installed.extend(["jit_log", "replay_log"])
    if mode() == TORCH_KERNELS:
        _torch_kernels()
    return list(_installed)


def _torch_kernels() -> None:
    if importlib.util.find_spec("sgl_kernel") is not None:
        raise RuntimeError(f"{VAR}={TORCH_KERNELS} but sgl_kernel is installed: this machine serves with the real "
                           f"kernels; run the check without --torch-kernels")
    from sglang_ext.cpu import kernels, stubs
    from sglang_ext.patches.wrap import when_imported

    for key, value in UPSTREAM_ENV.items():
        os.environ.setdefault(key, value)
    _installed.append("env:" + ",".join(UPSTREAM_ENV))
    _installed.extend(f"stub:{root}" for root in stubs.install())
    if "stub:sgl_kernel" in _installed:
        # SGLang's CUDA branches import more of sgl_kernel than its CPU path (quantization, ...): the same stub
        sys.meta_path.append(stubs._StubFinder(_SglKernelSubmodules()))
    stub = sys.modules.get("sgl_kernel")
    if stub is not None and stubs.is_stub(stub):
        device_agnostic = {n: f for n, f in kernels.IMPLEMENTED.items() if n != "copy_all_layer_kv_cache_cpu"}
        for name, fn in {**device_agnostic, **STUB_OPS}.items():
            setattr(stub, name, fn)
        _installed.append("ops:" + ",".join(sorted({**device_agnostic, **STUB_OPS})))
    when_imported("sglang.srt.speculative.dflash_utils", _chain_sampler)
    when_imported("sglang.srt.server_args", _backend_defaults)
    _installed.extend(["chain_sampler", "backend_defaults"])


def _chain_sampler(du: ModuleType) -> None:
    from sglang_ext.cpu.sampling import chain_speculative_sampling_target_only

    du.tree_speculative_sampling_target_only = chain_speculative_sampling_target_only
    du._DFLASH_SAMPLING_VERIFY_AVAILABLE = True
    # on CUDA these are FlashInfer's, imported lazily at the first top-k / top-p verify; None takes dflash_utils'
    # own torch renormalisation
    du.top_k_renorm_prob = None
    du.top_p_renorm_prob = None


def _backend_defaults(sa: ModuleType) -> None:
    from sglang_ext.patches.wrap import wrap

    def make(original):
        def resolve_once(self):
            for field, value in BACKENDS.items():
                if getattr(self, field, None) is None:
                    setattr(self, field, value)
            return original(self)

        return resolve_once

    wrap(sa.ServerArgs, "resolve_once", make)


def _log_jit(ju: ModuleType) -> None:
    """Log each JIT build; remember a failed one. SGLang caches only successes (`cache_once`) and some callers
    catch the failure and take a torch path (`can_use_store_cache`), so an unremembered failure would run nvcc
    again on every forward. `NO_JIT_VAR=1` fails every build at once: those torch paths only (run.sh --no-jit,
    for a machine whose nvcc cannot build them)."""
    from sglang_ext.patches.wrap import wrap

    failed: dict[str, BaseException] = {}

    def make(original):
        def load_jit(*args, **kwargs):
            key = repr((args, sorted(kwargs.items())))
            if key in failed:
                raise failed[key]
            logger.warning("%s %s", JIT_LOG_MARK, args[0] if args else kwargs)
            try:
                if os.environ.get(NO_JIT_VAR) == "1":
                    raise RuntimeError(f"{NO_JIT_VAR}=1: JIT kernels are off for this GPU check")
                return original(*args, **kwargs)
            except Exception as e:
                failed[key] = e
                logger.warning("%s %s failed: %s", JIT_LOG_MARK, args[0] if args else kwargs, e)
                raise

        return load_jit

    wrap(ju, "load_jit", make)


def _log_first_replay(dg: ModuleType) -> None:
    from sglang_ext.patches.wrap import wrap

    seen: set[int] = set()

    def make(original):
        def execute(self, forward_batch, *args, **kwargs):
            if id(self) not in seen:
                seen.add(id(self))
                logger.warning("%s %s (%s, batch %d)", REPLAY_LOG_MARK, getattr(self, "speculative_num_draft_tokens", 1),
                               forward_batch.forward_mode.name, forward_batch.batch_size)
            return original(self, forward_batch, *args, **kwargs)

        return execute

    wrap(dg.DecodeCudaGraphRunner, "execute", make)
