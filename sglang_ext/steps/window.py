"""A decode step's KV window: the slots its draft and verify forwards write past each request's committed prefix,
and the plan that binds both forwards to them."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import sglang.srt.speculative.dflash_worker_v2 as upstream
import torch

from sglang_ext.steps.context import StepContext

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepWindow:
    """The step's KV window: B slots per request past its committed prefix (upstream's block preparation)."""

    block_ids: torch.Tensor | None  # [bs, B]: the anchor, then mask tokens (the draft's input); None at width 1
    positions: torch.Tensor  # [bs, B]
    cache_loc: torch.Tensor  # [bs, B] KV slots
    plan: object  # kv_index_translator plan: binds the draft and verify forwards to the window
    prefix_lens: torch.Tensor  # [bs] committed lengths


def kv_plan(ctx: StepContext, write: torch.Tensor, read_extent: int) -> object:
    """The kv_index_translator plan of a window whose flat KV slots are ``write``, ``read_extent`` per request."""
    batch = ctx.batch
    return ctx.worker.target_worker.model_runner.kv_index_translator.plan(
        req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens,
        seq_lens_cpu=batch.seq_lens_cpu if batch.seq_lens_cpu is not None else ctx.draft_input.nxt_kv_lens_cpu,
        write_virtual=write, read_extent=read_extent)


def host_kv_bound(ctx: StepContext, width: int) -> tuple[torch.Tensor, int]:
    """(seq_lens_cpu, sum): a host upper bound of each request's KV length during a width-``width`` forward."""
    batch, draft_input = ctx.batch, ctx.draft_input
    if batch.seq_lens_cpu is not None:
        lens = batch.seq_lens_cpu + width
        return lens, int(lens.sum())
    if draft_input.nxt_kv_lens_cpu is not None:  # GPU-only backend: the reservation is a safe over-estimate
        return draft_input.nxt_kv_lens_cpu, int(draft_input.nxt_kv_lens_sum)
    lens = torch.tensor([req.kv.kv_allocated_len for req in batch.reqs], dtype=torch.int64)
    return lens, int(lens.sum())


def block_window(ctx: StepContext) -> StepWindow:
    """The step's KV window of B slots per request (upstream's block preparation, unchanged)."""
    w, batch, bs = ctx.worker, ctx.batch, ctx.bs
    B = w.max_block
    w._ensure_draft_block_buffers(bs)
    block_ids = w._draft_block_ids_buf[:bs]
    prefix_lens = batch.seq_lens
    positions_2d = w._draft_block_positions_buf[:bs]
    loc_2d = w._draft_verify_out_cache_loc_buf[:bs]
    req_to_token = w.model_runner.req_to_token_pool.req_to_token
    prepared = False
    if w._use_triton_prepare_block:
        try:
            upstream._prepare_dflash_draft_block_unchecked(
                bonus_tokens=ctx.draft_input.bonus_tokens.view(-1), prefix_lens=prefix_lens.view(-1),
                req_pool_indices=batch.req_pool_indices.view(-1), req_to_token=req_to_token,
                block_ids_out=block_ids, positions_out=positions_2d, cache_loc_out=loc_2d,
                mask_token_id=int(w._mask_token_id))
            prepared = True
        except Exception as e:  # same policy as upstream: fall back to eager for good
            w._use_triton_prepare_block = False
            logger.warning("DFLASH Triton prepare_block failed; falling back to eager path: %s", e)
    if not prepared:
        block_ids.fill_(int(w._mask_token_id))
        block_ids[:, 0].copy_(ctx.draft_input.bonus_tokens)
        torch.add(prefix_lens.unsqueeze(1), w._block_pos_offsets, out=positions_2d)
        loc = upstream.assign_extend_cache_locs_func(
            req_pool_indices=batch.req_pool_indices, req_to_token=req_to_token, start_offset=prefix_lens,
            end_offset=prefix_lens + B, batch_size=bs, draft_token_num=B, device=w.device)
        loc_2d.copy_(loc.view(bs, B))
    return StepWindow(block_ids, positions_2d, loc_2d, kv_plan(ctx, loc_2d.reshape(-1), B), prefix_lens)


def wide_window(ctx: StepContext, n: int) -> StepWindow:
    """A tree's window of n > B slots: positions prefix .. prefix + n - 1 (the decode reserve is widened for it,
    patches/dflash_headroom.py); the draft forward takes its first B columns, as from ``block_window``'s."""
    w, batch, bs = ctx.worker, ctx.batch, ctx.bs
    w._ensure_draft_block_buffers(bs)
    block_ids = w._draft_block_ids_buf[:bs]
    block_ids.fill_(int(w._mask_token_id))
    block_ids[:, 0].copy_(ctx.draft_input.bonus_tokens)
    prefix_lens = batch.seq_lens
    positions = prefix_lens.to(torch.int64).unsqueeze(1) + torch.arange(n, device=prefix_lens.device)
    req_to_token = w.model_runner.req_to_token_pool.req_to_token
    loc = req_to_token[batch.req_pool_indices.to(torch.int64).unsqueeze(1), positions].to(torch.int64)
    return StepWindow(block_ids, positions, loc, kv_plan(ctx, loc.reshape(-1), n), prefix_lens)


def width1_window(ctx: StepContext) -> StepWindow:
    """The first slot of the step's window only: the slot the scheduler reserved at the committed length."""
    batch, bs = ctx.batch, ctx.bs
    prefix_lens = batch.seq_lens
    req_to_token = ctx.worker.model_runner.req_to_token_pool.req_to_token
    loc = req_to_token[batch.req_pool_indices, prefix_lens].to(torch.int64).view(bs, 1)
    return StepWindow(None, prefix_lens.to(torch.int64).view(bs, 1), loc, kv_plan(ctx, loc.view(-1), 1), prefix_lens)
