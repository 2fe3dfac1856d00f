"""The tree verify's attention mask in the layout SGLang's GPU verify reads (tree/mask.py ``packed``): upstream's
Triton extend-attention kernel, run by Triton's interpreter on CPU tensors, attends exactly as the CPU path does
with the [bs, m, m] ancestor mask, and as the definition says (every node sees the prefix and its ancestors).

The GPU attention backends take ``DFlashVerifyInput.custom_mask`` flat -- FlashInfer's custom mask and the Triton
backend's read the same layout (EAGLE's tree mask; upstream's ``generate_attn_arg_prefill`` sizes it
prefix_sum * m + bs * m * m) -- and neither runs here, so the layout is pinned to the Triton kernel's own reads.
Runs in a child process: TRITON_INTERPRET must be set before Triton is imported, and SGLang's kernels import
through the CPU layer's stubs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

PROBE = r"""
import json, sys
import torch
from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
from sglang_ext.cpu.attention import attend, make_plan
from sglang_ext.tree.mask import ancestor_mask, packed

gen = torch.Generator().manual_seed(int(sys.argv[1]))
Hq, Hkv, D, N = 4, 2, 16, 6
m = 1 + N
prefix = torch.tensor([5, 0, 17, 9])  # ragged, one empty
bs = prefix.numel()
parent = torch.stack([torch.tensor([int(torch.randint(-1, i, (1,), generator=gen)) for i in range(N)])
                      for _ in range(bs)])  # node i's parent: the root (-1) or an earlier node
tree = ancestor_mask(parent)
req_to_token = torch.zeros(bs, 64, dtype=torch.int32)
slots = torch.randperm(256, generator=gen)[: int((prefix + m).sum())].to(torch.int32)
k_cache, v_cache = torch.randn(256, Hkv, D, generator=gen), torch.randn(256, Hkv, D, generator=gen)
q = torch.randn(bs * m, Hq, D, generator=gen)
ends = torch.cumsum(prefix + m, 0)
for i in range(bs):
    req_to_token[i, : int(prefix[i]) + m] = slots[int(ends[i]) - int(prefix[i]) - m: int(ends[i])]
scale = D ** -0.5
# the CPU path: the tree's K/V already in the cache, the [bs, m, m] mask
cpu = attend(make_plan(req_to_token, torch.arange(bs), prefix, m, causal=False, tree=tree), q, k_cache, v_cache,
             scale)
# upstream's kernel as the Triton backend calls it for a verify: the prefix from the pool, the tree's own K/V as
# the extend part, the packed mask and its per-request offsets
flat = packed(tree, prefix, int(prefix.sum()))
ext = torch.cat([req_to_token[i, int(prefix[i]): int(prefix[i]) + m] for i in range(bs)]).long()
o = torch.empty_like(q)
extend_attention_fwd(
    q, k_cache[ext].contiguous(), v_cache[ext].contiguous(), o, k_cache, v_cache,
    (torch.arange(bs + 1) * m).to(torch.int32),
    torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(prefix, 0)]).to(torch.int32),
    torch.cat([req_to_token[i, : int(prefix[i])] for i in range(bs)]).long(),
    flat, False, torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum((prefix + m) * m, 0)]), m, 1.0, 1.0,
    sm_scale=scale)
# the definition: node t attends to the whole prefix and to its ancestors (itself included)
ref = torch.empty_like(q)
for i in range(bs):
    keys = req_to_token[i, : int(prefix[i]) + m].long()
    for t in range(m):
        seen = torch.cat([torch.ones(int(prefix[i]), dtype=torch.bool), tree[i, t]])
        kk = k_cache[keys][seen].repeat_interleave(Hq // Hkv, 1)
        vv = v_cache[keys][seen].repeat_interleave(Hq // Hkv, 1)
        w = torch.softmax(torch.einsum("hd,khd->hk", q[i * m + t], kk) * scale, dim=-1)
        ref[i * m + t] = torch.einsum("hk,khd->hd", w, vv)
causal = torch.ones(m, m, dtype=torch.bool).tril()
print("RESULT" + json.dumps({
    "size": flat.numel(), "expected_size": int(prefix.sum()) * m + bs * m * m,
    "triton_vs_ref": float((o - ref).abs().max()), "cpu_vs_ref": float((cpu - ref).abs().max()),
    "branching": bool((tree != causal).any(dim=(1, 2)).all())}))
"""


@pytest.mark.parametrize("seed", [0, 1])
def test_upstream_triton_verify_attention_reads_the_packed_tree_mask_as_the_cpu_path_reads_the_tree(seed):
    env = dict(os.environ, DFLASH_SERVE_CPU="1", TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", PROBE, str(seed)], capture_output=True, text=True, env=env, cwd=REPO,
                       timeout=300)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT")), None)
    assert line, r.stderr[-3000:]
    got = json.loads(line[len("RESULT"):])
    assert got["size"] == got["expected_size"]  # what upstream's verify input sizes the mask to
    assert got["branching"], "every request's tree must branch, or a causal mask would pass too"
    assert got["cpu_vs_ref"] < 1e-5 and got["triton_vs_ref"] < 1e-5, got
