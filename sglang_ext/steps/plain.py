"""Speculation off as plain decoding runs it: a width-1 step that SGLang schedules, runs and processes as a plain
decode step -- its decode preparation, the target's DECODE forward and SGLang's sampler, its non-speculative result
processing -- with only the target's hidden features kept for the draft KV (their append deferred).

Why not the verify at width 1 (steps/width1.py): besides a TARGET_VERIFY forward and the speculative accept, a
speculative step pays SGLang's speculative scheduling around it -- the 2-block decode reservation, the batch snapshot
of its forward isolation, the accepted-run bookkeeping of its result -- each a little dearer than what plain
decoding runs for the same token (docs/BENCHMARKS.md, step profile).

Contract (one decode iteration of SGLang's non-overlap scheduler; patches/plain_decode.py calls these):
  * ``prepare_plain`` replaces the batch's speculative decode preparation once the controller chose width 1 for
    it ahead of the step: the batch becomes a plain decode batch (no speculative algorithm or state; the anchor as
    its input; the anchor's slot -- within the speculative reservation, renewed as the speculative preparation
    renews it when used up -- at each request's committed length, which grows by one as plain decoding's does);
  * ``decode_plain`` is the worker's step for such a batch: the target's decode forward with hidden capture and
    SGLang's sampler; the features are deferred for the draft KV;
  * ``before_plain_result`` / ``after_plain_result`` bracket SGLang's result processing: the per-request and
    scheduler speculative counters count the step as a verify step that accepted no draft (so request stats and
    SGLang's logged accept length stay whole), and the batch is speculative again afterwards, its next anchor the
    sampled token.
Invariants: the tokens are plain decoding's (the same forward mode, sampler and logit processing); the request's
KV bookkeeping (committed <= allocated) is what the speculative path expects at its next preparation; a batch
``plain_ready`` refuses (penalties, grammars, logprobs, hidden states, custom logit processors, sampling masks, beams,
overlap scheduling, hybrid targets, GPU) verifies at width 1 instead. GPU keeps the width-1 verify: its decode
CUDA graphs are captured for the verify width when speculation is on.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import sglang.srt.speculative.dflash_worker_v2 as upstream
import torch
from sglang.srt.mem_cache.allocation import alloc_for_spec_decode
from sglang.srt.mem_cache.allocation_sizing import page_aligned_decode_alloc_lens
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.runtime_context import get_spec
from sglang.srt.speculative.draft_worker_common import make_draft_input_v2

from sglang_ext.controller_loop import LaunchedStep
from sglang_ext.patches.plain_decode import PLAIN_ATTR
from sglang_ext.steps.context import StepContext
from sglang_ext.steps.tree import tree_serves
from sglang_ext.steps.verify import target_hidden

MADE_ATTR = "dflash_serve_after_plain"  # on a draft input after_plain_result made

if TYPE_CHECKING:
    from sglang.srt.managers.utils import GenerationBatchResult



def plain_ready(worker: Any, batch: Any) -> bool:
    """Whether this decode batch may run a width-1 step as plain decoding (read at decode preparation, from the
    scheduler's own batch): the CPU worker under the non-overlap scheduler, a full-attention target, and nothing in
    the batch that only the speculative path applies or reports -- a tree's rule (``tree_serves``: grammars,
    logprobs, penalties, custom logit processors, sampling masks), and hidden states, beams, HiSparse,
    encoder-decoder targets."""
    if not worker._prefix_drafts or upstream.is_cuda() or worker._need_mamba_verify_commit or batch.enable_overlap:
        return False
    if (batch.return_hidden_states or batch.beam_tail is not None or batch.hisparse_coordinator is not None
            or batch.model_config.is_encoder_decoder):
        return False
    return tree_serves(batch)


def prepare_plain(batch: Any) -> None:
    """The batch's decode preparation as plain decoding's (``ScheduleBatch.prepare_for_decode`` for a non-speculative
    batch), on the speculative path's KV bookkeeping: the anchor's slot is the one at the committed length -- within
    the speculative reservation already, or reserved now as the speculative preparation reserves."""
    draft_input = batch.spec_info
    setattr(batch, PLAIN_ATTR, (batch.spec_algorithm, draft_input))
    batch.forward_mode = ForwardMode.DECODE
    batch.spec_algorithm = upstream.SpeculativeAlgorithm.NONE
    batch.spec_info = None
    batch.input_embeds = batch.replace_embeds = batch.replace_positions = None
    if batch.sampling_info is not None:
        # the speculative path's forward copy (`copy_for_forward`) leaves the scheduler's own sampling info holding
        # the last penalized step's accumulated penalties, which SGLang's sampler would add here: with no penalizer
        # required (plain_ready), plain decoding's are none
        batch.sampling_info.acc_additive_penalties = batch.sampling_info.acc_scaling_penalties = None
    batch.maybe_evict_swa()
    if any(req.kv.kv_allocated_len <= req.kv.kv_committed_len for req in batch.reqs):
        # a request without its next slot: reserve as the speculative preparation does (2 blocks, so the next
        # plain steps find theirs reserved and allocate nothing; the scheduler's memory check counts that reserve)
        page_size = batch.token_to_kv_pool_allocator.page_size
        reserve = 2 * int(get_spec().speculative_num_draft_tokens)
        cur, nxt, needed = page_aligned_decode_alloc_lens(batch.reqs, reserve=reserve, page_size=page_size)
        cur_cpu, nxt_cpu = torch.tensor(cur, dtype=torch.int64), torch.tensor(nxt, dtype=torch.int64)
        alloc_for_spec_decode(batch.tree_cache, batch.req_to_token_pool, reqs=batch.reqs,
                              req_pool_indices=batch.req_pool_indices, cur_kv_lens=cur_cpu.to(batch.device),
                              cur_kv_lens_cpu=cur_cpu, nxt_kv_lens=nxt_cpu.to(batch.device), nxt_kv_lens_cpu=nxt_cpu,
                              num_needed_tokens=needed, batch=batch)
    committed = batch.seq_lens
    batch.out_cache_loc = batch.req_to_token_pool.req_to_token[batch.req_pool_indices, committed].to(torch.int64)
    batch.input_ids = draft_input.bonus_tokens.to(torch.int64)
    for req in batch.reqs:
        req.kv.kv_committed_len += 1
        req.decode_batch_idx += 1
    batch.seq_lens = committed + 1
    batch.seq_lens_cpu = (batch.seq_lens_cpu if batch.seq_lens_cpu is not None else committed.cpu()) + 1
    batch.orig_seq_lens = batch.seq_lens
    batch.seq_lens_sum = int(batch.seq_lens_cpu.sum())


def decode_plain(ctx: StepContext) -> GenerationBatchResult:
    """The worker's step for a batch ``prepare_plain`` made plain: the target's decode forward, SGLang's sampler."""
    w, batch, bs = ctx.worker, ctx.batch, ctx.bs
    target_out = w.target_worker.forward_batch_generation(
        batch, capture_hidden_mode=upstream.CaptureHiddenMode.FULL, return_kv_loc_plan=True)
    plan, target_out.kv_loc_plan = target_out.kv_loc_plan, None
    tokens = target_out.next_token_ids.view(bs).to(torch.int64)
    w._tp_sync.sync(upstream.SpecTpSyncSite.DFLASH_TARGET, tokens)
    logits_output = target_out.logits_output
    hidden = target_hidden(logits_output)
    cache_loc, positions = w._draft_write_ids(plan), (batch.seq_lens - 1).to(torch.int64)
    if w.draft_kv.defers:
        w.draft_kv.defer(hidden.reshape(bs, -1), cache_loc.reshape(-1), positions, batch.reqs)
    else:
        ones = torch.ones(bs, dtype=torch.int32, device=tokens.device)
        w.draft_kv.append(hidden.view(bs, 1, -1), cache_loc.view(bs, 1), positions.view(bs, 1), ones)
    logits_output.hidden_states = None
    w.loop.launched(LaunchedStep(ctx.rids, ctx.decision, None, tokens.view(bs, 1).to("cpu", non_blocking=True),
                                 plain=True))
    w.draft_kv.end_width1_step()
    target_out.next_token_ids = tokens
    return target_out


def before_plain_result(scheduler: Any, batch: Any) -> None:
    """Count the step as speculative result processing would: one verify step per request, no draft accepted
    (request stats: ``spec_verify_ct``; SGLang's logged accept length divides by its speculative step count)."""
    bs = batch.batch_size()
    scheduler.metrics_reporter.update_spec_metrics(bs, 0, num_accept_tokens=bs)
    for req in batch.reqs:
        if not (req.is_retracted or req.finished()):
            req.spec_verify_ct += 1
            req.update_spec_correct_drafts_histogram(0)


def after_plain_result(batch: Any, result: Any) -> None:
    """The batch is speculative again: its algorithm back, its next anchor the token just sampled."""
    batch.spec_algorithm, draft_input = getattr(batch, PLAIN_ATTR)
    delattr(batch, PLAIN_ATTR)
    if (getattr(draft_input, MADE_ATTR, False) and draft_input.topk_p.shape[0] == batch.batch_size()
            and draft_input.nxt_kv_lens_cpu is None and draft_input.future_indices is None
            and draft_input.verify_token_budget is None):
        # the state this function made after the last plain step, which nothing has filled since (a batch filter
        # or merge keeps its empty fields shaped to the batch): its two live fields renewed, every other as new;
        # a plain stretch then allocates no state per step
        draft_input.bonus_tokens = result.next_token_ids.to(dtype=torch.int64)
        draft_input.new_seq_lens = batch.seq_lens.to(dtype=torch.int64)
    else:
        draft_input = make_draft_input_v2(bonus_tokens=result.next_token_ids, new_seq_lens=batch.seq_lens)
        setattr(draft_input, MADE_ATTR, True)
    batch.spec_info = draft_input
