"""The accept of a tree verify: from the root, follow the target's own next token while it is a child.

Why one walk for greedy and sampling: the target's choice at node i -- its argmax, or one sample of its processed
distribution there, drawn for every node before the walk -- is used only if the walk reaches node i, so the
committed tokens are the target's choices one after another: plain decoding's tokens when greedy, a sample of the
target's distribution at any temperature (the draft only decides how many of them one step commits).

Contract: ``walk(trees, choice, depth=None)``: ``choice`` [bs, 1 + N] int64, the target's token after the root
(column 0) and after node i (column 1 + i); ``depth``: the path's width, at least the trees' deepest node (default:
that depth, one host sync; the worker passes the drafted block's). Returns (accepted [bs]: nodes walked, path
[bs, depth]: their indices, -1 past the end, bonus [bs]: the target's choice after the last node walked).
Committed this step: the path's tokens, then bonus.
Invariants: siblings carry distinct tokens (top-K), so at most one child matches; accepted <= the trees' depth.
How, without a loop over depths: node i is walked iff every node from it up to the root is the target's choice
at its parent (the ancestor mask picks those nodes), so the walked nodes are one per depth, 1..accepted.
"""
from __future__ import annotations

import torch

from sglang_ext.tree.build import Trees
from sglang_ext.tree.mask import ancestor_mask


def walk(trees: Trees, choice: torch.Tensor, depth: int | None = None,
         mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mask``: ``ancestor_mask(trees.parent)`` when the caller has it already (the verify did)."""
    bs, n = trees.token.shape
    if choice.shape != (bs, n + 1):
        raise ValueError(f"choice: expected shape ({bs}, {n + 1}), got {tuple(choice.shape)}")
    if depth is None:
        depth = int(trees.depth.max()) if n else 0
    if mask is None:
        mask = ancestor_mask(trees.parent)
    chosen = trees.token == choice.gather(1, trees.parent + 1)  # the target's choice at the node's parent
    walked = ~(mask[:, 1:, 1:] & ~chosen.unsqueeze(1)).any(dim=2)  # [bs, N]: every node root..i was chosen
    accepted = walked.sum(dim=1)
    path = torch.full((bs, depth + 1), -1, dtype=torch.int64, device=choice.device)
    idx = torch.arange(n, device=choice.device).expand(bs, n)
    # walked nodes go to their depth's column; the others to the spare last column, dropped below
    path.scatter_(1, torch.where(walked, trees.depth - 1, depth), torch.where(walked, idx, -1))
    path = path[:, :depth]
    last = path.gather(1, (accepted - 1).clamp(min=0).unsqueeze(1)).squeeze(1)  # the deepest walked node
    bonus = choice.gather(1, torch.where(accepted > 0, last + 1, 0).unsqueeze(1)).squeeze(1)
    return accepted, path, bonus
