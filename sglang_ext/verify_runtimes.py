"""Per-width target verify resources: the only GPU-specific part of the adaptive worker.

On CUDA, a target TARGET_VERIFY forward replays a CUDA graph captured for ONE verify width (the runner reads
``get_spec().speculative_num_draft_tokens`` when it captures; ``can_run_graph`` refuses any other width and the
forward silently runs eager). So every candidate width b gets its own target attention backend (fresh workspace)
and its own ``DecodeCudaGraphRunner(speculative_num_draft_tokens=b)``, captured at start-up inside
``init_cuda_graphs``. SGLang runs that after it sized the KV pool, so their memory is counted only where SGLang's
post-capture KV sizing backs the pool after capture (``SGLANG_ENABLE_POST_CAPTURE_KV_SIZING``: the launcher turns
it on for dflash_adaptive on GPU; SGLang turns it off for some configurations, and the worker then warns). The
width the server started with (the drafter's block B) keeps the startup backend and runner. Activating a width
swaps the target model runner's ``attn_backend`` and ``decode_cuda_graph_runner`` (what EAGLE's adaptive
``apply_runtime_state`` swaps on the target side).

A tree width (above B: a DDTree verify) has no graph of its own: it activates the start-up width's backend, whose
runner refuses any other width (``can_run_graph`` compares ``num_tokens_per_req`` with the width it captured), so
the tree verifies eagerly, reading its ancestor mask from ``DFlashVerifyInput.custom_mask``. Only the backends in
TREE_MASK_BACKENDS read it there (``tree_verify_refusal``); the worker refuses trees on any other at start-up. Not
built yet: a graph per tree width (capture with a custom-mask buffer, which upstream skips for DFLASH on these
backends), so a tree step pays eager launch costs the controller measures and prices.

On CPU (and with graphs disabled) one eager backend serves every width: the CPU layer's attention derives the width
from the query rows, so there is nothing to build and activation is a no-op. Nothing in this module runs here in
CI; tests/unit/test_gpu_contracts.py pins every upstream name and signature it calls to the installed SGLang.

The draft side needs nothing per width: the worker always drafts the full trained block with upstream's draft
runner, FlashInfer non-causal draft attention and draft CUDA graph.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class VerifyRuntime:
    width: int
    attn_backend: Any
    graph_runner: Any  # None: eager verify at this width


class VerifyRuntimes:
    """width -> VerifyRuntime; ``activate(b)`` before the verify forward of a width-b step."""

    def __init__(self, model_runner: Any, runtimes: dict[int, VerifyRuntime],
                 startup_width: int | None = None) -> None:
        self._mr = model_runner
        self._by_width = runtimes
        self._startup_width = startup_width
        self._active: int | None = None

    @classmethod
    def eager(cls, model_runner: Any) -> "VerifyRuntimes":
        """One backend for every width (CPU, or CUDA graphs disabled)."""
        return cls(model_runner, {})

    @property
    def extra_widths(self) -> list[int]:
        """Widths whose backend and graphs were built beside the start-up width's (empty when eager)."""
        return sorted(w for w in self._by_width if w != self._startup_width)

    def activate(self, width: int) -> None:
        if not self._by_width or width == self._active:
            return
        rt = self._by_width.get(width) or self._by_width[self._startup_width]  # a tree: eager (module docstring)
        self._mr.attn_backend = rt.attn_backend
        self._mr.decode_cuda_graph_runner = rt.graph_runner
        self._active = width


# Target attention backends whose eager TARGET_VERIFY reads DFlashVerifyInput.custom_mask in tree/mask.py's packed
# layout: FlashInfer (generate_attn_arg_prefill's mask into the verify prefill wrapper's plan) and Triton (extend
# attention, mask_indptr = n * (seq_lens + n) per request). Pinned: tests/unit/test_gpu_contracts.py.
TREE_MASK_BACKENDS = frozenset({"FlashInferAttnBackend", "TritonAttnBackend"})


def tree_verify_refusal(model_runner: Any) -> str | None:
    """Why this GPU target cannot verify a tree (None: it can): its verify attention backend (resolved through
    hybrid/TBO wrappers, as upstream resolves DFLASH's mask policy) must read the custom mask, and the KV page size
    must be 1 (the commit remaps the path's slots one by one in req_to_token)."""
    from sglang.srt.speculative.dflash_utils import resolve_dflash_verify_mask_policy

    name, _ = resolve_dflash_verify_mask_policy(model_runner.attn_backend)
    if name not in TREE_MASK_BACKENDS:
        known = ", ".join(sorted(TREE_MASK_BACKENDS))
        return (f"needs a target attention backend that reads a custom verify mask ({known}), not {name}: set "
                f"sglang_args.attention_backend to flashinfer or triton")
    page = int(getattr(model_runner, "page_size", 1) or 1)
    if page != 1:
        return f"needs KV page size 1, not {page}: unset sglang_args.page_size"
    return None


def capture_verify_runtimes(model_runner: Any, widths: list[int], startup_width: int) -> VerifyRuntimes:
    """CUDA: build a target attention backend and verify CUDA graph per width (GPU-only; see module docstring)."""
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, check_cuda_graph_backend
    from sglang.srt.model_executor.runner import DecodeCudaGraphRunner
    from sglang.srt.runtime_context import get_context, get_spec

    runtimes = {startup_width: VerifyRuntime(startup_width, model_runner.attn_backend,
                                             model_runner.decode_cuda_graph_runner)}
    if check_cuda_graph_backend(Phase.DECODE, Backend.DISABLED):
        return VerifyRuntimes.eager(model_runner)
    translator = model_runner.kv_index_translator
    saved = get_spec().speculative_num_draft_tokens
    try:
        for b in sorted(set(widths) - {startup_width}):
            tic = time.perf_counter()
            # The runner and the dummy verify input it captures with read the width from the published spec config.
            get_context().override("dflash_serve.capture_verify", speculative_num_draft_tokens=b)
            backup = model_runner.init_new_workspace
            try:
                backend = model_runner._get_attention_backend(init_new_workspace=True)
            finally:
                model_runner.init_new_workspace = backup
            translator.bind_and_verify_backends([backend])  # EAGLE's adaptive path skips this; ours must not
            runner = DecodeCudaGraphRunner(model_runner, attn_backend=backend, speculative_num_steps=1,
                                           speculative_num_draft_tokens=b)
            runtimes[b] = VerifyRuntime(b, backend, runner)
            logger.info("dflash-serve: captured target verify graphs for width %d in %.1fs", b,
                        time.perf_counter() - tic)
    finally:
        get_context().override("dflash_serve.capture_restore", speculative_num_draft_tokens=saved)
    return VerifyRuntimes(model_runner, runtimes, startup_width)
