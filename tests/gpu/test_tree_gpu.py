"""On a CUDA GPU, the tree step's own tensor logic (benchmarks/tree_cost.py ``tree_step``: the worker's
steps/tree.py decode_tree without the forwards) is what a CUDA graph per budget can hold, and the packed tree mask reads on the
compiled verify attention as the CPU path reads the tree.

- No part of the step waits for the host (``torch.cuda.set_sync_debug_mode("error")`` raises on any sync), the
  packed mask included (its size comes from the host's seq_lens_sum).
- Captured once per (load, budget) as a CUDA graph, a replay on new logits gives exactly what the eager step
  gives on them, and the GPU builds the trees, walks and window orders the CPU builds from the same logits.
- Upstream's Triton extend-attention kernel, compiled for this GPU at a Qwen3-8B-sized head (32 query / 8 KV
  heads of 128), reading ``packed``'s mask, attends as the definition says (tests/tree_attention_probe.py, which
  the CPU suite runs under Triton's interpreter) -- and differs when handed a chain's causal mask instead.

Needs only a GPU (no model pair): ``python3 -m pytest tests/gpu/test_tree_gpu.py``; the attention test also needs
SGLang's Triton attention kernels importable.
"""
from __future__ import annotations

import pytest
import torch

from benchmarks.tree_cost import captured, tree_step
from sglang_ext.tree.mask import packed

DEPTH = 15  # the bundled drafter's block (16) less the anchor
VOCAB = 4096  # the bundled pair's
K = 16  # the worker's top-k per position (capped at the budget)
LOADS = [1, 50]
BUDGETS = [15, 63]  # trees of 16 and 64 slots (root included)


def _logits(bs: int, seed: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(bs, DEPTH, VOCAB, generator=g) * 3).to(device)


@pytest.mark.parametrize("bs", LOADS)
@pytest.mark.parametrize("n", BUDGETS)
def test_the_tree_step_never_waits_for_the_host(bs, n):
    logits = _logits(bs, 0, "cuda")
    tree_step(logits, n, min(K, n))  # warm-up: first calls may allocate and load kernels
    prefix = torch.randint(0, 500, (bs,), generator=torch.Generator().manual_seed(bs)).cuda()
    prefix_sum = int(prefix.sum())  # the host knows it (seq_lens_sum): read before the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = tree_step(logits, n, min(K, n))
        flat = packed(out["mask"], prefix, prefix_sum)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert flat.numel() == prefix_sum * (n + 1) + bs * (n + 1) ** 2


@pytest.mark.parametrize("bs", LOADS)
@pytest.mark.parametrize("n", BUDGETS)
def test_a_cuda_graph_of_the_tree_step_replays_what_the_eager_step_computes(bs, n):
    static = _logits(bs, 0, "cuda")
    graph, out = captured(lambda: tree_step(static, n, min(K, n)))
    replays = []
    for seed in (1, 2):
        static.copy_(_logits(bs, seed, "cuda"))
        graph.replay()
        eager = tree_step(static, n, min(K, n))
        for key, value in eager.items():
            assert torch.equal(out[key], value), (seed, key)
        replays.append(out["token"].clone())
    assert not torch.equal(*replays), "the replay did not read the new logits"
    assert int(out["accepted"].min()) >= 1  # the first-child target walks at least one node


@pytest.mark.parametrize("bs", LOADS)
@pytest.mark.parametrize("n", BUDGETS)
def test_the_gpu_builds_and_walks_the_trees_the_cpu_does(bs, n):
    logits = _logits(bs, 3, "cpu")
    cpu, gpu = tree_step(logits, n, min(K, n)), tree_step(logits.cuda(), n, min(K, n))
    torch.testing.assert_close(gpu["score"].cpu(), cpu["score"], rtol=0, atol=1e-4)
    for key in ("token", "depth", "parent", "mask", "positions", "accepted", "path", "bonus", "order"):
        assert torch.equal(gpu[key].cpu(), cpu[key]), key


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 5e-3), (torch.bfloat16, 3e-2)])  # fp32: Triton's tf32 dots
@pytest.mark.parametrize("nodes", [15, 63])
def test_compiled_triton_verify_attention_reads_the_packed_tree_mask(dtype, tol, nodes):
    pytest.importorskip("sglang.kernels.ops.attention.extend_attention")
    from tests.tree_attention_probe import probe

    got = probe(nodes, "cuda", dtype, heads=(32, 8), head_dim=128, nodes=nodes, prefix=[5, 0, 300, 1000, 37])
    assert got["size"] == got["expected_size"]
    assert got["branching"]
    assert got["triton_vs_ref"] < tol and got["triton_causal_vs_ref"] < tol and got["cpu_vs_ref"] < tol, got
    assert got["causal_mask_vs_ref"] > 10 * tol, got
