"""Who attends to whom in a tree verify: every node to the root (the anchor), its ancestors and itself.

Contract: ``ancestor_mask(parent)`` with ``parent`` [bs, N] (``Trees.parent``: -1 = the root, else an earlier
node) -> [bs, 1 + N, 1 + N] bool, row/column 0 the root, row 1 + i node i; True where the row may attend to the
column. With the committed context before it (all visible) this is the attention of plain decoding along every
root-to-node path at once, which is what makes the verify's logits at node i the target's at that prefix.
``positions(prefix_lens, depth)``: [bs, 1 + N] sequence positions, the root at the prefix length, node i at
prefix length + its depth.
How: the reflexive-transitive closure of the parent relation by repeated squaring -- ceil(log2(1 + N)) batched
[1 + N, 1 + N] products, no loop over depths and no host sync (the step's hot path).
"""
from __future__ import annotations

import torch


def ancestor_mask(parent: torch.Tensor) -> torch.Tensor:
    bs, n = parent.shape
    m = n + 1
    up = torch.cat([torch.zeros(bs, 1, dtype=torch.int64, device=parent.device), parent + 1], dim=1)  # row -> parent
    reach = torch.zeros(bs, m, m, dtype=torch.float32, device=parent.device)
    reach.scatter_(2, up.unsqueeze(2), 1.0)  # one hop up (the root is its own parent)
    reach += torch.eye(m, device=parent.device)  # and itself
    hops = 1
    while hops < m:  # reach within 2 * hops after each squaring: every ancestor is < m hops away
        reach = torch.bmm(reach, reach).clamp_(max=1.0)
        hops *= 2
    return reach > 0


def positions(prefix_lens: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    root = torch.zeros(depth.shape[0], 1, dtype=depth.dtype, device=depth.device)
    return prefix_lens.to(depth.dtype).unsqueeze(1) + torch.cat([root, depth], dim=1)
