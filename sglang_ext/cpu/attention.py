"""Block attention for SGLang's torch-native backend on CPU: a query block against cached K/V.

Upstream `TorchNativeAttnBackend` has no TARGET_VERIFY path (forward_extend needs
`extend_prefix_lens`, which verify batches leave None), and its extend path attends a
redundant [L, L] query per request -- O(L^2) per decode step. DFlash uses TARGET_VERIFY
twice per step: the target verifies the block (causal) and the draft model drafts it
(ENCODER_ONLY layers: non-causal inside the block). Both are "n new tokens per request
whose K/V are already written at the end of the request's sequence", computed here in
O(L*n) per request, batched over requests with one SDPA call per layer.

The gather index and mask depend only on the batch, not the layer, so a `BlockPlan` is
built once per forward and reused by every layer.

A ragged block (`RaggedBlock`: request i has lens[i] <= block new tokens, its rows packed
request-major) is attended one group of equal lengths at a time (`ragged_plans`, `attend_groups`):
each group is an ordinary block of its length, so every row sees exactly the keys it would in a
block of lens[i] tokens. Why not one padded call: the padded rows cost query work for nothing
(measured per layer: docs/BENCHMARKS.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.functional import scaled_dot_product_attention


@dataclass(frozen=True)
class RaggedBlock:
    """A forward whose request i has ``lens[i]`` new tokens (1 <= lens[i] <= ``block``), packed request-major:
    ``rows`` [sum(lens)] are their indices in the padded [bs * block] layout."""

    lens: torch.Tensor  # [bs] int64
    rows: torch.Tensor  # [sum(lens)] int64
    block: int
    groups: tuple[tuple[int, torch.Tensor, torch.Tensor], ...]  # (length, its requests, their packed rows)

    @staticmethod
    def of(lens: torch.Tensor, block: int) -> "RaggedBlock":
        live = torch.arange(block, device=lens.device).view(1, block) < lens.view(-1, 1)
        start = torch.cumsum(lens, 0) - lens  # each request's first packed row
        groups = []
        for n in sorted(set(lens.tolist())):
            reqs = (lens == n).nonzero().view(-1)
            groups.append((int(n), reqs, (start[reqs].view(-1, 1) + torch.arange(n, device=lens.device)).view(-1)))
        return RaggedBlock(lens, live.view(-1).nonzero().view(-1), int(block), tuple(groups))

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[sum(lens), ...] -> [bs * block, ...], zeros in the padded rows."""
        out = x.new_zeros((self.lens.shape[0] * self.block, *x.shape[1:]))
        return out.index_copy_(0, self.rows, x)


@dataclass(frozen=True)
class BlockPlan:
    bs: int
    block: int
    max_len: int
    slots: torch.Tensor  # [bs * max_len] KV-cache rows, request-major (padded past each length)
    mask: torch.Tensor | None  # [bs, 1, block or 1, max_len] bool; None when every key is visible


def make_plan(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor, block: int, *,
              causal: bool, sliding_window: int | None = None, tree: torch.Tensor | None = None) -> BlockPlan:
    """Keys of request i are sequence positions [0, prefix_i + block). causal: query t
    (position prefix_i + t) sees keys <= its position; otherwise all of them (the DFlash
    draft's bidirectional block). sliding_window: only keys >= position - window.
    tree ([bs, block, block] bool, a tree verify's ancestor mask, sglang_ext/tree/mask.py):
    query t sees the whole prefix and block key u iff tree[i, t, u] -- in place of causal."""
    bs = prefix_lens.shape[0]
    prefix = prefix_lens.to(torch.long)
    kv_lens = prefix + block
    max_len = int(kv_lens.max()) if bs else 0
    slots = req_to_token[req_pool_indices.long(), :max_len].reshape(-1).long()
    window = sliding_window if sliding_window is not None and sliding_window > -1 else None
    ragged = bs > 1 and bool((kv_lens != max_len).any())
    if not (causal or window is not None or ragged or tree is not None):
        return BlockPlan(bs, block, max_len, slots, None)
    key_pos = torch.arange(max_len).view(1, 1, max_len)
    mask = key_pos < kv_lens.view(bs, 1, 1)
    if tree is not None:
        if window is not None or tree.shape != (bs, block, block):
            raise ValueError(f"tree mask: expected [{bs}, {block}, {block}] and no sliding window, got "
                             f"{tuple(tree.shape)}, window {window}")
        rel = key_pos - prefix.view(bs, 1, 1)  # the key's column in the block (< 0: the prefix)
        in_tree = tree.gather(2, rel.clamp(0, block - 1).expand(bs, block, max_len))
        mask = mask & ((rel < 0) | in_tree)
        return BlockPlan(bs, block, max_len, slots, mask.unsqueeze(1))
    if causal or window is not None:
        q_pos = prefix.view(bs, 1, 1) + torch.arange(block).view(1, block, 1)
        if causal:
            mask = mask & (key_pos <= q_pos)
        if window is not None:
            mask = mask & (key_pos >= q_pos - window)
    return BlockPlan(bs, block, max_len, slots, mask.unsqueeze(1))


def attend(plan: BlockPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           scaling: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [bs * block, Hq, D] -> [bs * block, Hq, Dv]. The block's own K/V must already be cached. sinks ([Hq],
    gpt-oss): a per-head logit in every row's softmax with no value (``with_sinks``)."""
    bs, block, n_kv = plan.bs, plan.block, plan.max_len
    if bs == 0:
        return q.new_empty((0, q.shape[1], v_cache.shape[-1]))
    # index_select on a 2-D view: advanced indexing is many times slower for large gathers
    key = k_cache.reshape(k_cache.shape[0], -1).index_select(0, plan.slots).view(bs, n_kv, *k_cache.shape[1:])
    value = v_cache.reshape(v_cache.shape[0], -1).index_select(0, plan.slots).view(bs, n_kv, *v_cache.shape[1:])
    query = q.view(bs, block, q.shape[1], q.shape[2]).transpose(1, 2)  # [bs, Hq, n, D]
    key, value = key.transpose(1, 2), value.transpose(1, 2)  # [bs, Hkv, L, D]
    if key.dtype != query.dtype:
        key, value = key.to(query.dtype), value.to(query.dtype)
    out = scaled_dot_product_attention(query, key, value, attn_mask=plan.mask, scale=scaling,
                                       enable_gqa=query.shape[1] != key.shape[1])
    if sinks is not None:
        out = with_sinks(out, query, key, plan.mask, scaling, sinks)
    return out.transpose(1, 2).reshape(bs * block, q.shape[1], value.shape[-1])


def with_sinks(out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None,
               scaling: float | None, sinks: torch.Tensor) -> torch.Tensor:
    """SDPA's output [bs, Hq, n, Dv] as if each head's softmax had one more logit, sinks[h], whose value is zero:
    softmax over (scores, sink) = softmax(scores) * sigmoid(logsumexp(scores) - sink)."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if key.shape[1] != query.shape[1]:
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scale  # [bs, Hq, n, L]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return out * torch.sigmoid(lse - sinks.float().view(1, -1, 1, 1)).to(out.dtype)


def ragged_plans(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                 ragged: RaggedBlock, *, causal: bool,
                 sliding_window: int | None = None) -> list[tuple[torch.Tensor, BlockPlan]]:
    """(packed rows, plan) of each group of equal lengths of a ragged block."""
    return [(rows, make_plan(req_to_token, req_pool_indices[reqs], prefix_lens[reqs], n, causal=causal,
                             sliding_window=sliding_window)) for n, reqs, rows in ragged.groups]


def attend_groups(groups: list[tuple[torch.Tensor, BlockPlan]], q: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, scaling: float | None = None,
                  sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``attend`` of a ragged block's packed q [sum(lens), Hq, D], one group at a time."""
    out = q.new_empty((q.shape[0], q.shape[1], v_cache.shape[-1]))
    for rows, plan in groups:
        out.index_copy_(0, rows, attend(plan, q.index_select(0, rows), k_cache, v_cache, scaling, sinks))
    return out


def block_attention(q, k_cache, v_cache, req_to_token, req_pool_indices, prefix_lens, block, *, causal: bool,
                    scaling: float | None = None, sliding_window: int | None = None) -> torch.Tensor:
    """One-shot form of make_plan + attend."""
    plan = make_plan(req_to_token, req_pool_indices, prefix_lens, block, causal=causal, sliding_window=sliding_window)
    return attend(plan, q, k_cache, v_cache, scaling)
