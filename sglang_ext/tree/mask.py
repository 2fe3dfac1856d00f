"""Who attends to whom in a tree verify: every node to the root (the anchor), its ancestors and itself.

Contract: ``ancestor_mask(parent)`` with ``parent`` [bs, N] (``Trees.parent``: -1 = the root, else an earlier
node) -> [bs, 1 + N, 1 + N] bool, row/column 0 the root, row 1 + i node i; True where the row may attend to the
column. With the committed context before it (all visible) this is the attention of plain decoding along every
root-to-node path at once, which is what makes the verify's logits at node i the target's at that prefix.
``positions(prefix_lens, depth)``: [bs, 1 + N] sequence positions, the root at the prefix length, node i at
prefix length + its depth.
How: the reflexive-transitive closure of the parent relation by repeated squaring -- ceil(log2(1 + N)) batched
[1 + N, 1 + N] products, no loop over depths and no host sync (the step's hot path).
``packed(mask, prefix_lens, prefix_sum)``: the same mask in the layout SGLang's GPU verify attention reads from
``DFlashVerifyInput.custom_mask`` (FlashInfer's custom mask and the Triton backend's, EAGLE's tree-mask layout:
``dflash_info.DFlashVerifyInput.generate_attn_arg_prefill`` sizes it prefix_sum * m + bs * m * m): per request in
batch order, m = 1 + N rows of prefix_i + m columns, row-major, the prefix columns True. The worker hands this
layout to every device; the CPU attention takes its tree columns back (``unpacked``: cpu/attention.py make_plan
reads [bs, m, m]), so CPU serving runs the very mask a GPU reads. Pinned to upstream's Triton extend-attention
kernel, run by Triton's interpreter: tests/unit/test_tree_packed_mask.py.
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


def packed(mask: torch.Tensor, prefix_lens: torch.Tensor, prefix_sum: int) -> torch.Tensor:
    """[bs, m, m] -> [prefix_sum * m + bs * m * m] bool (module docstring); ``prefix_sum`` >= sum(prefix_lens), from
    the host (a bound of the batch's lengths: no device sync; cells past the requests' rows stay True, unread)."""
    bs, m, _ = mask.shape
    out = torch.ones(prefix_sum * m + bs * m * m, dtype=torch.bool, device=mask.device)
    out[_tree_cells(prefix_lens, m).reshape(-1)] = mask.reshape(-1)
    return out


def unpacked(flat: torch.Tensor, prefix_lens: torch.Tensor, m: int) -> torch.Tensor:
    """``packed``'s tree columns back as [bs, m, m]: what the CPU attention reads of the verify's custom mask (the
    prefix columns, all True, are not read)."""
    return flat[_tree_cells(prefix_lens, m)]


def _tree_cells(prefix_lens: torch.Tensor, m: int) -> torch.Tensor:
    """[bs, m, m] indices into the packed layout of request b's row i, tree column j."""
    bs = prefix_lens.shape[0]
    p = prefix_lens.to(torch.int64).view(bs, 1, 1)
    cols = p + m  # a row's length: the prefix, then the m tree columns
    start = torch.cumsum(cols * m, dim=0) - cols * m  # where each request's rows begin
    i = torch.arange(m, device=prefix_lens.device)
    return start + i.view(1, m, 1) * cols + p + i.view(1, 1, m)
