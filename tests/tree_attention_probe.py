"""One tree verify's attention three ways: upstream's Triton extend-attention kernel reading the packed tree mask
(sglang_ext/tree/mask.py ``packed``), the CPU path's SDPA with the [bs, m, m] ancestor mask, and the definition
(every node sees the whole prefix, its ancestors and itself). Shared by the CPU test (Triton's interpreter, a child
process: tests/unit/test_tree_packed_mask.py) and the GPU test (the compiled kernel: tests/gpu/test_tree_gpu.py).

    python -m tests.tree_attention_probe SEED [--device cuda] [--dtype bfloat16] [--heads 32 8] [--head-dim 128]
        [--nodes 15] [--prefix 5 0 17 9]

prints one line ``RESULT{json}``: the packed size against upstream's, the largest error of the kernel (called with
is_causal off and on, as the Triton backend calls it) and of the CPU path (the mask packed and unpacked, as served)
against the definition (in the run's dtype), the kernel's error when handed a chain's causal mask instead
(large: the kernel reads the mask), and whether every request's tree branches.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from sglang_ext.cpu.attention import attend, make_plan
from sglang_ext.tree.mask import ancestor_mask, packed, unpacked


def probe(seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32, heads: tuple[int, int] = (4, 2),
          head_dim: int = 16, nodes: int = 6, prefix: list[int] | None = None) -> dict:
    from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

    gen = torch.Generator().manual_seed(seed)
    (hq, hkv), d, m = heads, head_dim, 1 + nodes
    prefix_t = torch.tensor(prefix if prefix is not None else [5, 0, 17, 9])  # ragged, one empty
    bs = prefix_t.numel()
    # node i's parent: the root (-1) or an earlier node
    parent = torch.stack([torch.tensor([int(torch.randint(-1, i, (1,), generator=gen)) for i in range(nodes)])
                          for _ in range(bs)])
    tree = ancestor_mask(parent)
    pool = int((prefix_t + m).sum()) + 64
    cols = int((prefix_t + m).max())
    req_to_token = torch.zeros(bs, cols, dtype=torch.int32)
    slots = torch.randperm(pool, generator=gen)[: int((prefix_t + m).sum())].to(torch.int32)
    k_cache, v_cache = torch.randn(pool, hkv, d, generator=gen), torch.randn(pool, hkv, d, generator=gen)
    q = torch.randn(bs * m, hq, d, generator=gen)
    ends = torch.cumsum(prefix_t + m, 0)
    for i in range(bs):
        p = int(prefix_t[i])
        req_to_token[i, : p + m] = slots[int(ends[i]) - p - m: int(ends[i])]
    scale = d ** -0.5
    # the definition, in float32: node t attends to the whole prefix and to its ancestors (itself included)
    ref = torch.empty_like(q)
    for i in range(bs):
        p = int(prefix_t[i])
        keys = req_to_token[i, : p + m].long()
        for t in range(m):
            seen = torch.cat([torch.ones(p, dtype=torch.bool), tree[i, t]])
            kk = k_cache[keys][seen].repeat_interleave(hq // hkv, 1)
            vv = v_cache[keys][seen].repeat_interleave(hq // hkv, 1)
            w = torch.softmax(torch.einsum("hd,khd->hk", q[i * m + t], kk) * scale, dim=-1)
            ref[i * m + t] = torch.einsum("hk,khd->hd", w, vv)
    # the CPU path, in the run's dtype: the tree's K/V already in the cache, the mask as the CPU attention gets it
    # in serving (the worker packs it, cpu_layer unpacks it)
    served = unpacked(packed(tree, prefix_t, int(prefix_t.sum())), prefix_t, m)
    cpu = attend(make_plan(req_to_token, torch.arange(bs), prefix_t, m, causal=True, tree=served), q.to(dtype),
                 k_cache.to(dtype), v_cache.to(dtype), scale)
    dev = torch.device(device)
    q, k_cache, v_cache = (x.to(dev, dtype) for x in (q, k_cache, v_cache))
    req_to_token, prefix_d, tree_d = req_to_token.to(dev), prefix_t.to(dev), tree.to(dev)
    ext = torch.cat([req_to_token[i, int(prefix_t[i]): int(prefix_t[i]) + m] for i in range(bs)]).long()
    zero = torch.zeros(1, dtype=torch.int64)

    def triton(mask: torch.Tensor, causal: bool = False) -> torch.Tensor:
        # upstream's kernel as the Triton backend calls it for a verify: the prefix from the pool, the tree's own
        # K/V as the extend part, the packed mask and its per-request offsets
        o = torch.empty_like(q)
        extend_attention_fwd(
            q, k_cache[ext].contiguous(), v_cache[ext].contiguous(), o, k_cache, v_cache,
            (torch.arange(bs + 1) * m).to(dev, torch.int32),
            torch.cat([zero, torch.cumsum(prefix_t, 0)]).to(dev, torch.int32),
            torch.cat([req_to_token[i, : int(prefix_t[i])] for i in range(bs)]).long(),
            packed(mask, prefix_d, int(prefix_t.sum())), causal,
            torch.cat([zero, torch.cumsum((prefix_t + m) * m, 0)]).to(dev), m, 1.0, 1.0, sm_scale=scale)
        return o.float().cpu()

    causal = torch.ones(m, m, dtype=torch.bool).tril()
    return {
        "device": str(dev), "dtype": str(dtype).removeprefix("torch."), "requests": bs, "nodes": nodes,
        "size": packed(tree_d, prefix_d, int(prefix_t.sum())).numel(),
        "expected_size": int(prefix_t.sum()) * m + bs * m * m,
        "triton_vs_ref": float((triton(tree_d) - ref).abs().max()),
        # as the Triton backend calls it in a verify (a decoder layer is causal): the mask still rules, and a tree's
        # ancestors precede their nodes
        "triton_causal_vs_ref": float((triton(tree_d, causal=True) - ref).abs().max()),
        "cpu_vs_ref": float((cpu.float() - ref).abs().max()),
        "causal_mask_vs_ref": float((triton(causal.expand(bs, m, m).to(dev)) - ref).abs().max()),
        "branching": bool((tree != causal).any(dim=(1, 2)).all())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("seed", type=int)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--heads", type=int, nargs=2, default=[4, 2], metavar=("Q", "KV"))
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--nodes", type=int, default=6)
    p.add_argument("--prefix", type=int, nargs="+", default=[5, 0, 17, 9])
    a = p.parse_args(argv)
    got = probe(a.seed, a.device, getattr(torch, a.dtype), tuple(a.heads), a.head_dim, a.nodes, a.prefix)
    print("RESULT" + json.dumps(got), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
