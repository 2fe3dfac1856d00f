"""The N most likely draft prefixes of every request in a batch, from the drafter's per-position marginals.

Why: one DFlash draft forward yields a distribution q_d at every block position d; a chain verify uses only the
argmax path. DDTree (arXiv 2604.12989) verifies the N most likely prefixes under the factorised score
s(x_1..x_d) = sum_{j<=d} log q_j(x_j) instead: a tree (a prefix never scores above its parent, log q <= 0), and
the best N-node tree for that surrogate. The reference pops a heap one node at a time, one request at a time:
N sequential steps per request.

How, for the whole batch at once: by depth. A depth-d prefix among the best N has its parent among the best N,
so it is among the N best one-token extensions of the N best depth-(d-1) prefixes:
S_1 = top-N of q_1's top-K, S_d = top-N(S_{d-1} x top-K of q_d) -- one top-N of [bs, N * K] per depth
(D selections, not N heap steps). The tree is the N best of S_1 u .. u S_D, stably sorted by score with shallower
prefixes first on ties: every parent then precedes its children, and a cut through equal scores never keeps a
child without its parent.

Contract: ``build_trees(logp, tokens, budget)``:
  logp   [bs, D, K] float: log-probabilities of the drafter's top-K tokens at positions 1..D, sorted descending
         along K (torch.topk's order); tokens [bs, D, K] their ids (distinct along K);
  budget N >= 1: nodes per request, the root (the step's anchor, already committed) not counted.
  Returns ``Trees`` with [bs, N] fields: token, depth (1..D), parent (the index of an earlier node, -1 = the
  root) and score, nodes in order of score (descending).
Invariants (tests/unit/test_tree.py, against brute-force enumeration on small vocabularies): the scores are the N
best prefix scores, as a multiset; every node's parent precedes it and is one level shallower; no two nodes
spell the same prefix; the same inputs give the same tree on every tensor-parallel rank (top-k and sort are
deterministic for equal inputs on equal devices; which of two equal-scored prefixes a depth keeps may differ
from a heap's, never the scores).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Trees:
    """A batch of draft trees, N nodes each (see the module contract)."""

    token: torch.Tensor  # [bs, N] int64
    depth: torch.Tensor  # [bs, N] int64, 1..D
    parent: torch.Tensor  # [bs, N] int64, -1 = the root, else < the node's own index
    score: torch.Tensor  # [bs, N] float: the prefix's summed draft log-probability

    @property
    def budget(self) -> int:
        return int(self.token.shape[1])


def prefix_count(depth: int, k: int) -> int:
    """How many prefixes of length 1..depth the top-``k`` tokens of every position spell (the largest budget)."""
    return sum(k ** d for d in range(1, depth + 1))


def build_trees(logp: torch.Tensor, tokens: torch.Tensor, budget: int) -> Trees:
    """The ``budget`` best draft prefixes of every request (module docstring)."""
    if logp.dim() != 3 or tokens.shape != logp.shape:
        raise ValueError(f"logp and tokens: expected equal [bs, depth, k] shapes, got {tuple(logp.shape)} and "
                         f"{tuple(tokens.shape)}")
    bs, D, K = logp.shape
    N = int(budget)
    if not 1 <= N <= prefix_count(D, K):
        raise ValueError(f"budget: must be in 1..{prefix_count(D, K)} for {D} positions x top-{K}, got {budget}")
    # per depth, the kept prefixes: their scores and their index into [previous depth's list] x K (parent-major)
    score = logp[:, 0, : min(K, N)]
    scores, picks = [score], [torch.arange(score.shape[1], device=logp.device).expand(bs, -1)]
    for d in range(1, D):
        flat = (score.unsqueeze(2) + logp[:, d].unsqueeze(1)).reshape(bs, -1)
        pick = torch.topk(flat, min(N, flat.shape[1]), dim=1).indices  # ties: any order (the final sort is stable)
        score = flat.gather(1, pick)
        scores.append(score)
        picks.append(pick)
    widths = [s.shape[1] for s in scores]
    starts = [sum(widths[:d]) for d in range(D)]
    all_scores = torch.cat(scores, dim=1)  # depth-major: a stable sort keeps shallower prefixes first on ties
    chosen = torch.sort(all_scores, dim=1, descending=True, stable=True).indices[:, :N]
    pick = torch.cat(picks, dim=1)
    # per entry of the concatenation: its 0-based depth, and where the previous depth's entries start (filled on
    # the device, not copied from a host list: no host-to-device copy in a step a CUDA graph replays)
    depth0 = torch.cat([torch.full((w,), d, dtype=torch.int64, device=logp.device)
                        for d, w in enumerate(widths)])
    prev_start = torch.cat([torch.full((w,), starts[d - 1] if d else 0, dtype=torch.int64, device=logp.device)
                            for d, w in enumerate(widths)])
    # every entry's parent as an index into the concatenation (-1 at depth 1); its token from its rank at its depth
    parent_flat = torch.where(depth0 > 0, prev_start + pick // K, -1)
    token_flat = tokens.reshape(bs, D * K).gather(1, depth0 * K + pick % K)
    node_of = torch.full_like(pick, -1)  # concatenation index -> node index, -1 = not kept
    node_of.scatter_(1, chosen, torch.arange(N, device=logp.device).expand(bs, N))
    parent = parent_flat.gather(1, chosen)
    parent = torch.where(parent >= 0, node_of.gather(1, parent.clamp(min=0)), parent)
    return Trees(token=token_flat.gather(1, chosen).to(torch.int64), depth=depth0[chosen] + 1, parent=parent,
                 score=all_scores.gather(1, chosen))
