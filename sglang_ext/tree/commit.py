"""Where a tree verify's committed tokens end up: the window's columns reordered so the accepted path comes first.

Why: the tree verify writes node i's KV to column i of the request's window (sequence positions prefix + i as the
scheduler allocated them), but the committed sequence is the root, then the accepted path's nodes -- not columns
1..k. Reordering the window's slots in ``req_to_token`` (position prefix + j -> the slot of the path's j-th node)
keeps the accepted KV where the committed sequence expects it with no copy of K/V; the other slots move past the
committed length, still owned by the request (the scheduler's over-allocation), and are overwritten next step.

Contract: ``window_order(path, n)``: ``path`` [bs, D] (``walk``'s: node indices of the accepted path, -1 past its
end), ``n`` = 1 + the tree's node count (the window's columns in use). Returns [bs, n] int64, a permutation of
0..n-1 per request: column 0 (the root) first, then 1 + path[j] for every walked node in path order, then every
other column in ascending order. Gathering any per-column tensor of the window with it puts the committed tokens'
entries at the front.
"""
from __future__ import annotations

import torch


def window_order(path: torch.Tensor, n: int) -> torch.Tensor:
    bs, depth = path.shape
    cols = torch.arange(n, device=path.device)
    rank = (n + cols).expand(bs, n).clone()  # unwalked columns: after every walked one, in column order
    rank[:, 0] = 0
    walked = path >= 0
    # -1 entries scatter rank 0 onto column 0, which holds 0 already
    rank.scatter_(1, torch.where(walked, path + 1, 0),
                  torch.where(walked, torch.arange(1, depth + 1, device=path.device).expand(bs, depth), 0))
    return torch.argsort(rank, dim=1)
