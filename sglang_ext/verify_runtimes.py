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

A tree width (above B: a DDTree verify) gets its own backend and graph too, captured with the runner's custom-mask
buffer (``TreeVerifyGraphRunner``): upstream captures DFLASH verify on FlashInfer and Triton without a mask (their
causal path expresses a chain), and a graph captured so would attend causally over a tree. Captured with the mask,
FlashInfer builds the width's verify wrappers around its custom-mask buffer and re-plans every replay with the
step's ``DFlashVerifyInput.custom_mask`` (with plan()'s host reads: the sync-free fast plan is installed only for
maskless DFLASH graphs); Triton copies the step's mask into its verify-mask buffer every replay; padded requests get
upstream's all-ones padding. Only the backends in refusals.TREE_MASK_BACKENDS read the mask (``tree_verify_refusal``); the
worker refuses trees on any other at start-up. A tree's graphs stop at the batch sizes whose rows fit SGLang's
shared logits buffer (``tree_capture_sizes``); a larger tree batch verifies eagerly on the tree width's backend,
with the same mask.

On CPU (and with graphs disabled) one eager backend serves every width: the CPU layer's attention derives the width
from the query rows, so there is nothing to build and activation is a no-op. Capture runs only on a GPU; CI runs
the tree runner's capture input against upstream's (tests/unit/test_verify_runtimes.py), and
tests/unit/test_gpu_contracts.py pins every upstream name, signature and behaviour used here to the installed
SGLang.

The draft side needs nothing per width: the worker always drafts the full trained block with upstream's draft
runner, FlashInfer non-causal draft attention and draft CUDA graph.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import time
from dataclasses import dataclass
from typing import Any, Iterator

from sglang_ext.refusals import tree_attention_refusal

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
        # a width without graphs (a tree too wide for every captured batch size) verifies eagerly on the start-up
        # backend: its runner refuses other widths, and it reads a tree's mask eagerly too
        rt = self._by_width.get(width) or self._by_width[self._startup_width]
        self._mr.attn_backend = rt.attn_backend
        self._mr.decode_cuda_graph_runner = rt.graph_runner
        self._active = width


def tree_verify_refusal(model_runner: Any) -> str | None:
    """Why this GPU target cannot verify a tree (None: it can): the rule is refusals.tree_attention_refusal's, on
    the verify attention backend resolved through hybrid/TBO wrappers as upstream resolves DFLASH's mask policy."""
    from sglang.srt.speculative.dflash_utils import resolve_dflash_verify_mask_policy

    name, _ = resolve_dflash_verify_mask_policy(model_runner.attn_backend)
    return tree_attention_refusal(name, int(getattr(model_runner, "page_size", 1) or 1))


@functools.cache
def tree_graph_runner_class() -> type:
    """SGLang's verify graph runner, capturing with its custom-mask buffer so the graph reads a tree's mask.

    Upstream call site: ``DecodeCudaGraphRunner.get_spec_info``, which ``capture_prepare`` calls for the dummy
    verify input of each captured batch size, and which passes ``custom_mask=None`` for DFLASH on the backends in
    ``_DFLASH_VERIFY_SKIP_CUSTOM_MASK_BACKENDS`` (FlashInfer and Triton among them). Retire when upstream captures
    DFLASH verify with a mask for widths that need one. Pinned: tests/unit/test_gpu_contracts.py.
    """
    from sglang.srt.model_executor.runner import DecodeCudaGraphRunner

    class TreeVerifyGraphRunner(DecodeCudaGraphRunner):
        def get_spec_info(self, num_tokens: int):
            spec_info = super().get_spec_info(num_tokens)
            spec_info.custom_mask = self.buffers.custom_mask  # capture plans with it; a replay, with the step's mask
            return spec_info

    return TreeVerifyGraphRunner


def tree_capture_sizes(batch_sizes: list[int], width: int, logits_rows: int) -> list[int]:
    """The decode graph batch sizes a tree of ``width`` verify tokens is captured at: those whose rows fit SGLang's
    shared logits buffer (``logits_rows``), which every verify graph writes and which is sized for the published
    width B at the largest batch size. A tree is wider than B, so its graphs stop at a smaller batch; a larger tree
    batch verifies eagerly. Trees pay at small batches only (docs/DDTREE.md), so that costs little, where growing
    the buffer would cost max_bs x width x vocab x 4 bytes (10 GB at 256 x 64 x Qwen3's vocabulary)."""
    return sorted(bs for bs in set(batch_sizes) if bs * width <= logits_rows)


@contextlib.contextmanager
def published_capture_sizes(sizes: list[int] | None) -> Iterator[None]:
    """While a verify graph runner is built: SGLang's published decode graph batch sizes are ``sizes`` (None: left
    as they are). The runner reads them from the published graph config (``get_batch_sizes_to_capture``)."""
    if sizes is None:
        yield
        return
    from sglang.srt.model_executor.cuda_graph_config import Phase, with_phase
    from sglang.srt.runtime_context import get_context, get_exec

    graphs = get_exec().graph.cuda_graph_config
    get_context().override("dflash_serve.capture_tree", cuda_graph_config=with_phase(graphs, Phase.DECODE, bs=sizes))
    try:
        yield
    finally:
        get_context().override("dflash_serve.capture_restore", cuda_graph_config=graphs)


def capture_verify_runtimes(model_runner: Any, widths: list[int], startup_width: int) -> VerifyRuntimes:
    """CUDA: build a target attention backend and verify CUDA graph per width (GPU-only; see module docstring).
    A width above ``startup_width`` (the drafter's block) verifies a tree: captured with the mask, at the batch
    sizes ``tree_capture_sizes`` keeps (none kept: it verifies eagerly on the start-up backend)."""
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, check_cuda_graph_backend
    from sglang.srt.model_executor.runner import DecodeCudaGraphRunner
    from sglang.srt.runtime_context import get_context, get_exec, get_spec

    runtimes = {startup_width: VerifyRuntime(startup_width, model_runner.attn_backend,
                                             model_runner.decode_cuda_graph_runner)}
    if check_cuda_graph_backend(Phase.DECODE, Backend.DISABLED):
        return VerifyRuntimes.eager(model_runner)
    translator = model_runner.kv_index_translator
    saved = get_spec().speculative_num_draft_tokens
    try:
        for b in sorted(set(widths) - {startup_width}):
            tic = time.perf_counter()
            tree, sizes = b > startup_width, None
            if tree:
                shared = model_runner.graph_shared_output
                sizes = tree_capture_sizes(list(get_exec().graph.cuda_graph_config.decode.bs or []), b,
                                           shared.max_rows if shared else 0)
                if not sizes:
                    logger.info("dflash-serve: tree width %d verifies eagerly (no captured batch size fits SGLang's "
                                "shared logits buffer at this width)", b)
                    continue
            # The runner and the dummy verify input it captures with read the width from the published spec config.
            get_context().override("dflash_serve.capture_verify", speculative_num_draft_tokens=b)
            backup = model_runner.init_new_workspace
            try:
                backend = model_runner._get_attention_backend(init_new_workspace=True)
            finally:
                model_runner.init_new_workspace = backup
            translator.bind_and_verify_backends([backend])  # EAGLE's adaptive path skips this; ours must not
            runner_class = tree_graph_runner_class() if tree else DecodeCudaGraphRunner
            with published_capture_sizes(sizes):
                runner = runner_class(model_runner, attn_backend=backend, speculative_num_steps=1,
                                      speculative_num_draft_tokens=b)
            runtimes[b] = VerifyRuntime(b, backend, runner)
            logger.info("dflash-serve: captured target verify graphs for width %d%s in %.1fs", b,
                        f" (a tree: with its custom mask, batch sizes up to {max(runner.capture_bs)})" if tree else "",
                        time.perf_counter() - tic)
    finally:
        get_context().override("dflash_serve.capture_restore", speculative_num_draft_tokens=saved)
    return VerifyRuntimes(model_runner, runtimes, startup_width)
