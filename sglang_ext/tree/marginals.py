"""The drafter's top-k log-probabilities per position, without sorting the vocabulary: a tree step's input.

Why: torch.topk and torch.logsumexp over whole vocabulary rows cost far more on CPU than reading them: most of a
tree step's own work at load (benchmarks/tree_cost.py; docs/DDTREE.md). The k largest logits of a row lie in the k
vocabulary chunks with the largest maxima (a value among the k largest has at most k - 1 values above it, so at
most k - 1 chunks have a larger maximum than its own chunk), so one max per chunk, a top-k of the chunk maxima and
a top-k of those k chunks' entries find them exactly; the normaliser is one exp-sum shifted by the row's maximum
(the largest of them).

Contract: ``top_log_probs(logits, k)``: ``logits`` [..., V] float -> (logp [..., k] sorted descending, tokens
[..., k] int64 distinct per row): the k largest log-softmax values of every row and their token ids -- the values
torch.topk(log_softmax(logits), k) gives (which of several tied tokens is kept may differ).
"""
from __future__ import annotations

import torch

CHUNK = 64  # vocabulary entries per chunk: sqrt-sized for vocabularies of a few thousand to a few hundred thousand


def top_log_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    *lead, vocab = logits.shape
    if not 1 <= k <= vocab:
        raise ValueError(f"k: must be in 1..{vocab}, got {k}")
    rows = logits.reshape(-1, vocab).float()
    chunks = -(-vocab // CHUNK)
    if chunks <= k:  # too few chunks to skip any: the plain top-k
        top = torch.topk(rows, k, dim=-1)
        values, tokens = top.values, top.indices
    else:
        padded = rows if vocab == chunks * CHUNK else torch.nn.functional.pad(
            rows, (0, chunks * CHUNK - vocab), value=float("-inf"))
        blocks = padded.view(-1, chunks, CHUNK)
        best = torch.topk(blocks.amax(dim=-1), k, dim=-1).indices  # [R, k] chunks holding the k largest
        cand = blocks.gather(1, best.unsqueeze(-1).expand(-1, k, CHUNK)).reshape(-1, k * CHUNK)
        top = torch.topk(cand, k, dim=-1)
        values = top.values
        tokens = best.gather(1, top.indices // CHUNK) * CHUNK + top.indices % CHUNK
    # log-sum-exp from the row maximum (the top value): cheaper on CPU than torch.logsumexp
    peak = values[:, :1]
    logp = values - peak - torch.log((rows - peak).exp_().sum(dim=-1, keepdim=True))
    return logp.view(*lead, k), tokens.view(*lead, k)
