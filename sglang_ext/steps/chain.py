"""A chain step at width b <= B with a draft: the drafter over its full block B, or -- with prefix drafts, where
the draft runs eagerly (CPU) -- over the first b positions only, as upstream's block-b DFlash does; the target
verifies [anchor, d_1 .. d_{b-1}] in the first b slots of the window, upstream's accept at width b, and the
committed tokens' features appended to the draft KV. The controller's probes draft the full block at any b < B."""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

import torch

from sglang_ext.controller_loop import LaunchedStep
from sglang_ext.steps.context import StepContext
from sglang_ext.steps.draft import draft_forward
from sglang_ext.steps.verify import verify_chain
from sglang_ext.steps.window import block_window

if TYPE_CHECKING:
    from sglang.srt.managers.utils import GenerationBatchResult

    from sglang_ext.steps.upstream_surface import UpstreamWorker


@contextlib.contextmanager
def selector_sample_as(worker: UpstreamWorker, q: tuple[torch.Tensor, torch.Tensor] | None) -> Iterator[None]:
    """Upstream's accept (and its check whether the verify may skip the full logits) reads a DFlash2 path's q from
    ``worker._selector_sample``: ``q`` there for this step's verify only, None after."""
    worker._selector_sample = q
    try:
        yield
    finally:
        worker._selector_sample = None


def decode_chain(ctx: StepContext) -> GenerationBatchResult:
    w, bs, b, B = ctx.worker, ctx.bs, ctx.decision.block_size, ctx.worker.max_block
    w.draft_kv.flush()  # the draft reads its KV: it must hold every committed token
    window = block_window(ctx)
    tokens = w._draft_block_tokens_buf[:bs]  # [bs, B]: anchor, then the drafted block
    tokens[:, 0].copy_(ctx.draft_input.bonus_tokens)
    drafted, q = None, None
    if ctx.decision.draft_full:
        draft = draft_forward(ctx, window, B)
        tokens[:, 1:].copy_(draft.tokens)
        drafted = tokens[:, 1:].to("cpu", non_blocking=True)
        q = draft.selector_q
        if q is not None and b < B:  # a DFlash2 path's q, for its prefix
            q = None if b == 1 else (q[0][:, : b - 1], q[1][:, : b - 1])
    elif b > 1:  # the controller asks for less than the full block only with prefix drafts
        draft = draft_forward(ctx, window, b)
        tokens[:, 1:b].copy_(draft.tokens)
        q = draft.selector_q
    cand = tokens if b == B else tokens[:, :b].contiguous()
    with selector_sample_as(w, q):
        result = verify_chain(ctx, window, cand, b)
    committed = result.next_token_ids.view(bs, b).to("cpu", non_blocking=True)
    w.loop.launched(LaunchedStep(ctx.rids, ctx.decision, drafted, committed))
    return result
