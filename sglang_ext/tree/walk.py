"""The accept of a tree verify: from the root, follow the target's own next token while it is a child.

Why one walk for greedy and sampling: the target's choice at node i -- its argmax, or one sample of its processed
distribution there, drawn for every node before the walk -- is used only if the walk reaches node i, so the
committed tokens are the target's choices one after another: plain decoding's tokens when greedy, a sample of the
target's distribution at any temperature (the draft only decides how many of them one step commits).

Contract: ``walk(trees, choice)``: ``choice`` [bs, 1 + N] int64, the target's token after the root (column 0) and
after node i (column 1 + i). Returns (accepted [bs]: nodes walked, path [bs, D]: their indices, -1 past the end,
bonus [bs]: the target's choice after the last node walked). Committed this step: the path's tokens, then bonus.
Invariants: siblings carry distinct tokens (top-K), so at most one child matches; accepted <= D.
"""
from __future__ import annotations

import torch

from sglang_ext.tree.build import Trees


def walk(trees: Trees, choice: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    bs, n = trees.token.shape
    if choice.shape != (bs, n + 1):
        raise ValueError(f"choice: expected shape ({bs}, {n + 1}), got {tuple(choice.shape)}")
    depth = int(trees.depth.max()) if n else 0
    cur = torch.full((bs,), -1, dtype=torch.int64, device=choice.device)  # -1: the root
    path = torch.full((bs, depth), -1, dtype=torch.int64, device=choice.device)
    accepted = torch.zeros(bs, dtype=torch.int64, device=choice.device)
    for d in range(depth):
        want = choice.gather(1, (cur + 1).unsqueeze(1))  # the target's token after the current node
        match = (trees.parent == cur.unsqueeze(1)) & (trees.token == want)  # once stopped, stays stopped
        found = match.any(dim=1)
        nxt = match.to(torch.int8).argmax(dim=1)
        cur = torch.where(found, nxt, cur)
        path[:, d] = torch.where(found, nxt, path[:, d])
        accepted += found.to(torch.int64)
    bonus = choice.gather(1, (cur + 1).unsqueeze(1)).squeeze(1)
    return accepted, path, bonus
