"""Who attends to whom in a tree verify: every node to the root (the anchor), its ancestors and itself.

Contract: ``ancestor_mask(parent)`` with ``parent`` [bs, N] (``Trees.parent``: -1 = the root, else an earlier
node) -> [bs, 1 + N, 1 + N] bool, row/column 0 the root, row 1 + i node i; True where the row may attend to the
column. With the committed context before it (all visible) this is the attention of plain decoding along every
root-to-node path at once, which is what makes the verify's logits at node i the target's at that prefix.
``positions(prefix_lens, depth)``: [bs, 1 + N] sequence positions, the root at the prefix length, node i at
prefix length + its depth.
"""
from __future__ import annotations

import torch


def ancestor_mask(parent: torch.Tensor) -> torch.Tensor:
    bs, n = parent.shape
    eye = torch.eye(n + 1, dtype=torch.bool, device=parent.device).expand(bs, n + 1, n + 1)
    up = torch.cat([torch.zeros(bs, 1, dtype=torch.int64, device=parent.device), parent + 1], dim=1)  # row -> parent row
    mask = eye.clone()
    hop = up  # the root is its own parent: every row reaches it
    for _ in range(n):  # add one more generation of ancestors per pass; parents precede children, so <= depth passes
        reached = eye.gather(1, hop.unsqueeze(2).expand(bs, n + 1, n + 1))
        if not (reached & ~mask).any():
            break
        mask |= reached
        hop = up.gather(1, hop)
    return mask


def positions(prefix_lens: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    root = torch.zeros(depth.shape[0], 1, dtype=depth.dtype, device=depth.device)
    return prefix_lens.to(depth.dtype).unsqueeze(1) + torch.cat([root, depth], dim=1)
