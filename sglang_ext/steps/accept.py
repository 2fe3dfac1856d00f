"""The accept of a chain step: upstream's at the candidates' width, or plain decoding's token at width 1; and the
target's own token at every verified row, which a tree's walk and a ragged step's accept follow."""
from __future__ import annotations

import sglang.srt.speculative.dflash_utils as dflash_utils
import sglang.srt.speculative.dflash_worker_v2 as upstream
import torch
from sglang.srt.layers.sampler import sampling_from_probs_torch

from sglang_ext import verify_rows
from sglang_ext.patches.verify_sampling import ORCHESTRATOR
from sglang_ext.steps.context import StepContext, block_size_as

# upstream's (accept_len, commit_lens, bonus, out_tokens, new_seq_lens: None when the caller computes them)
Accepted = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"]


def accept_chain(ctx: StepContext, cand: torch.Tensor, logits: torch.Tensor | None,
                 target_predict: torch.Tensor | None, prefix_lens: torch.Tensor) -> Accepted:
    """Upstream's accept of [bs, w] chain candidates, at their width w."""
    w = ctx.worker
    with block_size_as(w, int(cand.shape[1])):
        return w._accept_block(candidates=cand, next_token_logits=logits, sampling_info=ctx.batch.sampling_info,
                               draft_input=ctx.draft_input, prefix_lens=prefix_lens, bs=ctx.bs,
                               target_predict=target_predict)


def accept_width1(ctx: StepContext, cand: torch.Tensor, logits: torch.Tensor | None,
                  target_predict: torch.Tensor | None, prefix_lens: torch.Tensor) -> Accepted:
    """The accept of a width-1 step: no draft to verify, so the step commits plain decoding's token for the
    anchor's row -- its argmax, or a sample of the distribution plain decoding samples (SGLang's own sampling
    function; a softmax alone when no top-k/top-p/min_p applies, as in SGLang's sampler). Upstream's chain accept
    would reach the same distribution through a sort of the vocabulary and the chain kernel, a cost measured in
    docs/BENCHMARKS.md (CPU step profile)."""
    bs, sampling_info, draft_input = ctx.bs, ctx.batch.sampling_info, ctx.draft_input
    if logits is not None and sampling_info is not None:  # penalties and logit_bias, as every accept
        verify_rows.apply_accept_adjustments(logits.view(bs, 1, -1), cand, sampling_info,
                                             getattr(sampling_info, ORCHESTRATOR, None))
    if target_predict is not None or upstream._is_all_greedy(sampling_info):
        bonus = target_predict if target_predict is not None else torch.argmax(logits, dim=-1)
        site = upstream.SpecTpSyncSite.DFLASH_ACCEPT_GREEDY
    else:
        if (sampling_info.need_top_p_sampling or sampling_info.need_top_k_sampling
                or sampling_info.need_min_p_sampling):
            probs = dflash_utils.build_speculative_verify_target_probs(  # patched: the sampler's cuts
                next_token_logits=logits, sampling_info=sampling_info, draft_token_num=1, bs=bs,
                max_top_k=draft_input.max_top_k, uniform_top_k_value=draft_input.uniform_top_k_value)
        else:
            probs = torch.softmax(logits.float() / sampling_info.temperatures, dim=-1)
        bonus = sampling_from_probs_torch(probs.view(bs, -1))
        site = upstream.SpecTpSyncSite.DFLASH_ACCEPT_SAMPLE
    bonus = bonus.view(bs).to(torch.int64)
    ctx.worker._tp_sync.sync(site, bonus)
    accept_len = torch.zeros(bs, dtype=torch.int32, device=bonus.device)
    return accept_len, accept_len + 1, bonus, bonus.view(bs, 1), None


def target_choices(ctx: StepContext, logits: torch.Tensor | None, target_predict: torch.Tensor | None,
                   n: int, rows_of: torch.Tensor | None = None) -> torch.Tensor:
    """The target's token after every verified row: its argmax, or one sample of the distribution plain decoding
    samples there (logit_bias, temperature, top-k/top-p/min_p: the chain accept's own functions). ``logits``
    [bs * n, V] -> [bs, n]; or a ragged step's packed rows ([R, V], ``rows_of`` [R] the request of each, CPU's
    pytorch sampler) -> [R]. A caller that accepts while the next candidate equals the choice at its row, and commits
    the choice at the first row where it does not, commits the target's samples one after another: for a
    deterministic draft that is rejection sampling's distribution (accept d with probability q(d), else a sample of
    q without d), at any temperature. Penalties are not applied here: the caller replays them per row first (a
    ragged step: steps/ragged.py), or has none (a tree step: ``tree.tree_serves``)."""
    bs, sampling_info, draft_input = ctx.bs, ctx.batch.sampling_info, ctx.draft_input
    if target_predict is not None:
        choice, site = target_predict, upstream.SpecTpSyncSite.DFLASH_ACCEPT_GREEDY
    else:
        rep = ((lambda t: t.repeat_interleave(n, dim=0)) if rows_of is None
               else (lambda t: t.index_select(0, rows_of)))
        if sampling_info is not None and sampling_info.logit_bias is not None:
            bias = sampling_info.logit_bias.to(logits.dtype)
            if rows_of is None:  # a [bs, n] block: broadcast over its rows
                logits.view(bs, n, -1).add_(bias[:, None, :])
            else:
                logits.add_(bias.index_select(0, rows_of))
        if upstream._is_all_greedy(sampling_info):
            choice, site = torch.argmax(logits, dim=-1), upstream.SpecTpSyncSite.DFLASH_ACCEPT_GREEDY
        else:
            if rows_of is None:
                probs = dflash_utils.build_speculative_verify_target_probs(  # patched: the sampler's cuts
                    next_token_logits=logits, sampling_info=sampling_info, draft_token_num=n, bs=bs,
                    max_top_k=draft_input.max_top_k, uniform_top_k_value=draft_input.uniform_top_k_value)
            else:  # only the rows verified: a full-width padded layout would cut and sample every padded row too
                probs = verify_rows.sampler_probs(logits, sampling_info, rep)
            choice = sampling_from_probs_torch(probs.reshape(logits.shape[0], -1))
            site = upstream.SpecTpSyncSite.DFLASH_ACCEPT_SAMPLE
    choice = choice.to(torch.int64)
    choice = choice.view(bs, n) if rows_of is None else choice.view(-1)
    ctx.worker._tp_sync.sync(site, choice)
    return choice
