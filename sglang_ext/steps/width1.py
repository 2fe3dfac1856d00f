"""Speculation off (b = 1 without a draft) where it cannot be a plain decode step (steps/plain.py: GPU, overlap
scheduling, batches with penalties, grammars or logprobs): verify the anchor alone in the first slot of the window
and defer the draft-KV append (draft_kv.DraftKV)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from sglang_ext.controller_loop import LaunchedStep
from sglang_ext.steps.context import StepContext
from sglang_ext.steps.verify import verify_chain
from sglang_ext.steps.window import width1_window

if TYPE_CHECKING:
    from sglang.srt.managers.utils import GenerationBatchResult


def decode_width1(ctx: StepContext) -> GenerationBatchResult:
    w, bs = ctx.worker, ctx.bs
    window = width1_window(ctx)
    cand = ctx.draft_input.bonus_tokens.view(bs, 1)
    result = verify_chain(ctx, window, cand, 1, defer_append=w.draft_kv.defers)
    committed = result.next_token_ids.view(bs, 1).to("cpu", non_blocking=True)
    w.loop.launched(LaunchedStep(ctx.rids, ctx.decision, None, committed))
    w.draft_kv.end_width1_step()
    return result
