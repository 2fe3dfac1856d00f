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
        rt = self._by_width[width]
        self._mr.attn_backend = rt.attn_backend
        self._mr.decode_cuda_graph_runner = rt.graph_runner
        self._active = width


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
