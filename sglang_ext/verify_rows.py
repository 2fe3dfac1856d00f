"""Per-row sampling state of a DFlash verify block: what plain decoding would apply at each row.

Why: a verify block of width b holds the logits of b consecutive positions of one request. Row j predicts the token
after [anchor, d_1 .. d_j]; plain decoding would have committed those j + 1 tokens before sampling it, so its
penalties (frequency, presence, repetition), its min_new_tokens EOS ban and its min_p filter differ per row.
SGLang 0.5.23 applies one row of penalties to every row -- in fact none: the scheduler hands the worker a
`copy_for_forward()` of the sampling info whose penalizer orchestrator is None, and DFlash never cumulates output
tokens into the penalizers -- and never applies min_p in verify. Greedy outputs then differ from plain decoding and
sampled ones come from another distribution (docs/ARCHITECTURE.md §5, patches/verify_sampling.py).

Contract:
  * ``apply_row_penalties(logits3d, cand, orchestrator)``: in place on ``[bs, b, V]`` logits, bit for bit what
    plain decoding computes (``SamplingBatchInfo.apply_logits_bias``'s accumulated additive penalties in the
    orchestrator's order, then the scaling ones), with the orchestrator's state = tokens committed before the anchor;
  * ``apply_accept_adjustments(logits3d, cand, sampling_info, orchestrator)``: the row penalties, then logit_bias
    -- everything plain decoding applies to a row's logits before its sampler;
  * ``cumulate_rounds(orchestrator, tokens, mask)``: feed committed tokens to the penalizers, one token per request
    per round (masked rows skip the round), exactly as plain decoding's one-token-per-step cumulation would;
  * ``target_probs_torch(...)``: the distribution SGLang's pytorch sampler (the CPU backend) samples from --
    temperature, then top-k and top-p cut on the *unrenormalised* sorted probabilities, then min_p against the
    largest probability -- for every verify row (``sampler_probs``: with each row's request's parameters, greedy
    and uncut rows without the sort on CPU); ``apply_min_p(probs, min_ps)`` for renormalised backends.
Invariants: no host sync off the CPU (``sampler_probs`` reads its rows' kinds on the host on CPU only), no Python
loop over requests (loops are over the block's b <= 16 positions); the same code runs on CPU and GPU.
"""
from __future__ import annotations

import torch

FREQUENCY, PRESENCE, REPETITION, MIN_NEW_TOKENS = ("BatchedFrequencyPenalizer", "BatchedPresencePenalizer",
                                                   "BatchedRepetitionPenalizer", "BatchedMinNewTokensPenalizer")
KNOWN = (FREQUENCY, PRESENCE, REPETITION, MIN_NEW_TOKENS)


class UnsupportedPenalizer(RuntimeError):
    """A penalizer this module cannot replay per row (a new SGLang version added one): refuse, never guess."""


def active_penalizers(orchestrator) -> list:
    """The prepared penalizers in the orchestrator's (plain decoding's) order."""
    if orchestrator is None or not orchestrator.is_required:
        return []
    out = [p for p in orchestrator.penalizers.values() if getattr(p, "_is_prepared", False)]
    unknown = [type(p).__name__ for p in out if type(p).__name__ not in KNOWN]
    if unknown:
        raise UnsupportedPenalizer(f"no per-row replay for {unknown}")
    return out


def _first_positions(cand: torch.Tensor) -> torch.Tensor:
    """[bs, b]: for each position i, the first position holding the same token (i itself when it is new)."""
    b = cand.shape[1]
    same = cand[:, :, None] == cand[:, None, :]  # [bs, i, i']
    earlier = torch.ones(b, b, dtype=torch.bool, device=cand.device).tril()  # i' <= i
    return (same & earlier).to(torch.int8).argmax(dim=2)  # the first True


def apply_row_penalties(logits3d: torch.Tensor, cand: torch.Tensor, orchestrator) -> None:
    penalizers = active_penalizers(orchestrator)
    if not penalizers:
        return
    bs, b, _ = logits3d.shape
    cand = cand.to(torch.int64)
    idx = cand[:, None, :].expand(bs, b, b)  # [bs, row j, position i] -> token cand[r, i]
    rows = torch.arange(b, device=cand.device)
    first = _first_positions(cand)  # [bs, b]
    committed = first[:, None, :] <= rows[None, :, None]  # [bs, j, i]: token of i is among cand[r, :j + 1]
    additive = torch.zeros_like(logits3d, dtype=torch.float32)
    scaling = None
    for p in penalizers:
        name = type(p).__name__
        if name == FREQUENCY:
            base, pen = p.cumulated_frequency_penalties, p.frequency_penalties  # [bs, V], [bs, 1]
            before = additive.gather(2, idx)
            # the count plain decoding would have reached, added one occurrence at a time as it does
            cum = base.gather(1, cand)[:, None, :].expand(bs, b, b).clone()
            for i in range(b):
                hit = (cand[:, i:i + 1] == cand)[:, None, :] & (i <= rows)[None, :, None]  # [bs, j, i']
                cum = cum + torch.where(hit, pen[:, :, None], 0.0)
            additive.sub_(base[:, None, :])
            additive.scatter_(2, idx, before - cum)
        elif name == PRESENCE:
            base, pen = p.cumulated_presence_penalties, p.presence_penalties
            before = additive.gather(2, idx)
            value = torch.where(committed, pen[:, :, None], base.gather(1, cand)[:, None, :])
            additive.sub_(base[:, None, :])
            additive.scatter_(2, idx, before - value)
        elif name == MIN_NEW_TOKENS:
            row_len = p.len_output_tokens + 1 + rows[None, :]  # [bs, b]: outputs before row j's token
            banned = row_len < p.min_new_tokens
            additive.add_(torch.where(banned[:, :, None], p.stop_token_penalties[:, None, :], 0.0))
        else:  # REPETITION (multiplicative: applied after every additive one, as plain decoding does)
            base, pen = p.cumulated_repetition_penalties, p.repetition_penalties
            value = torch.where(committed, pen[:, :, None], base.gather(1, cand)[:, None, :])
            scale = base[:, None, :].expand(bs, b, base.shape[1]).clone()
            scale.scatter_(2, idx, value)
            scaling = scale if scaling is None else scaling * scale
    logits3d.add_(additive.to(logits3d.dtype))
    if scaling is not None:
        scaling = scaling.to(logits3d.dtype)
        logits3d.copy_(torch.where(logits3d < 0, logits3d * scaling, logits3d / scaling))


def apply_accept_adjustments(logits3d: torch.Tensor, cand: torch.Tensor, sampling_info, orchestrator) -> None:
    """In place on ``[bs, b, V]`` logits: row-j penalties, then logit_bias (plain decoding's order)."""
    apply_row_penalties(logits3d, cand, orchestrator)
    if sampling_info.logit_bias is not None:
        logits3d.add_(sampling_info.logit_bias[:, None, :].to(logits3d.dtype))


def cumulate_rounds(orchestrator, tokens: torch.Tensor, mask: torch.Tensor) -> None:
    """``tokens``/``mask``: [bs, rounds]; round k feeds tokens[:, k] where mask[:, k] (plain decoding's per-step
    cumulation of one token per request)."""
    penalizers = active_penalizers(orchestrator)
    tokens = tokens.to(torch.int64)
    for k in range(tokens.shape[1]):
        tok, on = tokens[:, k:k + 1], mask[:, k:k + 1]
        for p in penalizers:
            name = type(p).__name__
            if name == FREQUENCY:
                p.cumulated_frequency_penalties.scatter_add_(1, tok, torch.where(on, p.frequency_penalties, 0.0))
            elif name == PRESENCE:
                cum = p.cumulated_presence_penalties
                cum.scatter_(1, tok, torch.where(on, p.presence_penalties, cum.gather(1, tok)))
            elif name == REPETITION:
                cum = p.cumulated_repetition_penalties
                cum.scatter_(1, tok, torch.where(on, p.repetition_penalties, cum.gather(1, tok)))
            else:  # MIN_NEW_TOKENS
                p.len_output_tokens.add_(on.to(p.len_output_tokens.dtype))


def target_probs_torch(scaled_logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                       min_ps: torch.Tensor | None, *, simple: bool = False,
                       max_top_k: int | None = None) -> torch.Tensor:
    """Rows of temperature-scaled logits -> the distribution of SGLang's pytorch sampler
    (layers/sampler.py `top_k_top_p_min_p_sampling_from_probs_torch`), renormalised.

    ``simple``: no request of the batch sets top-k, top-p or min_p (`Sampler`'s ``simple_sampling_case``): the
    sampler draws from the softmax itself, and so does this. ``max_top_k`` (`SamplingBatchInfo.max_top_k`, every
    request's top-k when all are set): the cuts need only the ``max_top_k`` largest, as the sampler takes them.
    Why both: a full vocabulary sort of every verify row cost more than the verify forward itself on CPU, a
    softmax a small part of it (docs/BENCHMARKS.md).
    """
    probs = torch.softmax(scaled_logits.float(), dim=-1)
    if simple:
        return probs
    if max_top_k is not None and max_top_k < probs.shape[-1]:
        probs_sort, probs_idx = torch.topk(probs, k=max_top_k, dim=-1, sorted=True)
    else:
        probs_sort, probs_idx = probs.sort(dim=-1, descending=True)
    probs_sum = torch.cumsum(probs_sort, dim=-1)
    ranks = torch.arange(probs_sort.shape[-1], device=probs.device).view(1, -1)
    probs_sort[ranks >= top_ks.view(-1, 1)] = 0.0
    probs_sort[(probs_sum - probs_sort) > top_ps.view(-1, 1)] = 0.0
    if min_ps is not None:
        probs_sort[probs_sort < (probs_sort[:, 0] * min_ps).view(-1, 1)] = 0.0
    probs_sort = probs_sort / probs_sort.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, probs_idx, probs_sort)


def sampler_probs(logits: torch.Tensor, sampling_info, rep) -> torch.Tensor:
    """[rows, V] logits -> the pytorch sampler's distribution at each row (``target_probs_torch``), each row with its
    request's temperature, top-k, top-p and min_p: ``rep`` maps a per-request tensor of the batch to one per row.

    On CPU each kind of row is computed at its own cost: a greedy request's row (top-k 1: the sampler's
    distribution is its top token) is that token's one-hot, a row with no top-k, top-p or min_p the softmax, and
    only the rows that set a cut go through the sorted probabilities. Why: a batch mixing greedy and sampled
    requests sets the sampler's top-k flag, and cutting every row sorts the whole vocabulary of every verify row
    (on CPU more than a step's verify forward). One host sync, for the row kinds; elsewhere the batch's flags
    decide for every row (no sync)."""
    need_min_p = bool(getattr(sampling_info, "need_min_p_sampling", False))
    temps, top_ks, top_ps = rep(sampling_info.temperatures), rep(sampling_info.top_ks), rep(sampling_info.top_ps)
    min_ps = rep(sampling_info.min_ps) if need_min_p else None
    simple = not (need_min_p or getattr(sampling_info, "need_top_p_sampling", True)
                  or getattr(sampling_info, "need_top_k_sampling", True))
    if simple or logits.device.type != "cpu":
        return target_probs_torch(logits / temps, top_ks, top_ps, min_ps, simple=simple,
                                  max_top_k=getattr(sampling_info, "max_top_k", None))
    vocab = logits.shape[-1]
    greedy = top_ks == 1
    cut = (~greedy) & ((top_ks < vocab) | (top_ps < 1.0) | ((min_ps > 0.0) if min_ps is not None else False))
    probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    probs.scatter_(1, torch.argmax(logits, dim=-1, keepdim=True), 1.0)  # every row; sampled rows overwritten
    temps = temps.view(-1, 1)
    for rows, cuts in (((~greedy & ~cut).nonzero().view(-1), False), (cut.nonzero().view(-1), True)):
        if rows.numel() == 0:
            continue
        scaled = logits.index_select(0, rows) / temps.index_select(0, rows)
        if cuts:
            ks = top_ks.index_select(0, rows)
            part = target_probs_torch(scaled, ks, top_ps.index_select(0, rows),
                                      None if min_ps is None else min_ps.index_select(0, rows),
                                      max_top_k=int(ks.max()) if bool((ks < vocab).all()) else None)
        else:
            part = torch.softmax(scaled.float(), dim=-1)
        probs.index_copy_(0, rows, part)
    return probs


def apply_min_p(probs: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """[rows, V] renormalised probabilities -> min_p against each row's largest, renormalised (flashinfer's
    `min_p_sampling_from_probs` semantics, which SGLang's GPU sampler applies after top-k/top-p renorm)."""
    keep = probs >= probs.max(dim=-1, keepdim=True).values * min_ps.view(-1, 1)
    out = torch.where(keep, probs, 0.0)
    return out / out.sum(dim=-1, keepdim=True)
