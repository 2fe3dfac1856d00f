"""A chain step at width b <= B with a draft: the drafter over its full block B, or -- with prefix drafts, where
the draft runs eagerly (CPU) -- over the first b positions only, as upstream's block-b DFlash does; the target
verifies [anchor, d_1 .. d_{b-1}] in the first b slots of the window, upstream's accept at width b, and the
committed tokens' features appended to the draft KV. The controller's probes draft the full block at any b < B."""
from __future__ import annotations

from typing import TYPE_CHECKING

from sglang_ext.controller_loop import LaunchedStep
from sglang_ext.steps.context import StepContext
from sglang_ext.steps.draft import draft_forward
from sglang_ext.steps.verify import verify_chain
from sglang_ext.steps.window import block_window

if TYPE_CHECKING:
    from sglang.srt.managers.utils import GenerationBatchResult


def decode_chain(ctx: StepContext) -> GenerationBatchResult:
    w, bs, b, B = ctx.worker, ctx.bs, ctx.decision.block_size, ctx.worker.max_block
    w.draft_kv.flush()  # the draft reads its KV: it must hold every committed token
    window = block_window(ctx)
    tokens = w._draft_block_tokens_buf[:bs]  # [bs, B]: anchor, then the drafted block
    tokens[:, 0].copy_(ctx.draft_input.bonus_tokens)
    drafted = None
    if ctx.decision.draft_full:
        tokens[:, 1:].copy_(draft_forward(ctx, window, B).tokens)
        drafted = tokens[:, 1:].to("cpu", non_blocking=True)
    elif b > 1:  # the controller asks for less than the full block only with prefix drafts
        tokens[:, 1:b].copy_(draft_forward(ctx, window, b).tokens)
    if w._selector_sample is not None and ctx.decision.draft_full and b < B:  # a DFlash2 path's q, for its prefix
        w._selector_sample = None if b == 1 else tuple(t[:, : b - 1] for t in w._selector_sample)
    cand = tokens if b == B else tokens[:, :b].contiguous()
    result = verify_chain(ctx, window, cand, b)
    committed = result.next_token_ids.view(bs, b).to("cpu", non_blocking=True)
    w.loop.launched(LaunchedStep(ctx.rids, ctx.decision, drafted, committed))
    return result
