"""The CPU layer's attention sinks (gpt-oss): each head's softmax has one more logit, with no value."""
from __future__ import annotations

import torch

from sglang_ext.cpu.attention import attend, make_plan


def test_block_attention_with_sinks_equals_the_explicit_softmax():
    g = torch.Generator().manual_seed(0)
    bs, block, hq, hkv, d, window = 2, 3, 4, 2, 8, 4
    prefix = torch.tensor([5, 2])
    slots = 16
    k_cache, v_cache = torch.randn(2 * slots, hkv, d, generator=g), torch.randn(2 * slots, hkv, d, generator=g)
    req_to_token = torch.arange(2 * slots).view(2, slots)
    q = torch.randn(bs * block, hq, d, generator=g)
    sinks = torch.randn(hq, generator=g)
    plan = make_plan(req_to_token, torch.tensor([0, 1]), prefix, block, causal=True, sliding_window=window)
    got = attend(plan, q, k_cache, v_cache, 0.5, sinks)

    for i in range(bs):
        for t in range(block):
            pos = int(prefix[i]) + t
            keys = [p for p in range(pos + 1) if p >= pos - window]
            k = k_cache[req_to_token[i, keys]].repeat_interleave(hq // hkv, dim=1)  # [n, hq, d]
            v = v_cache[req_to_token[i, keys]].repeat_interleave(hq // hkv, dim=1)
            scores = torch.einsum("hd,nhd->hn", q[i * block + t], k) * 0.5
            probs = torch.softmax(torch.cat([scores, sinks.view(hq, 1)], dim=1), dim=1)[:, :-1]
            want = torch.einsum("hn,nhd->hd", probs, v)
            torch.testing.assert_close(got[i * block + t], want, atol=1e-5, rtol=1e-5)
