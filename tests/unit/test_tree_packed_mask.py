"""The tree verify's attention mask in the layout SGLang's GPU verify reads (tree/mask.py ``packed``): upstream's
Triton extend-attention kernel, run by Triton's interpreter on CPU tensors, attends exactly as the CPU path does
with the [bs, m, m] ancestor mask, and as the definition says (every node sees the prefix and its ancestors).

The GPU attention backends take ``DFlashVerifyInput.custom_mask`` flat -- FlashInfer's custom mask and the Triton
backend's read the same layout (EAGLE's tree mask; upstream's ``generate_attn_arg_prefill`` sizes it
prefix_sum * m + bs * m * m) -- and neither runs here, so the layout is pinned to the Triton kernel's own reads.
Runs in a child process (tests/tree_attention_probe.py, which the GPU test runs on the compiled kernel):
TRITON_INTERPRET must be set before Triton is imported, and SGLang's kernels import through the CPU layer's stubs.
"""
from __future__ import annotations

import pytest

from tests.conftest import child_result


@pytest.mark.parametrize("seed", [0, 1])
def test_upstream_triton_verify_attention_reads_the_packed_tree_mask_as_the_cpu_path_reads_the_tree(seed):
    got = child_result("-m", "tests.tree_attention_probe", str(seed), TRITON_INTERPRET="1")
    assert got["size"] == got["expected_size"]  # what upstream's verify input sizes the mask to
    assert got["branching"], "every request's tree must branch, or a causal mask would pass too"
    assert got["cpu_vs_ref"] < 1e-5 and got["triton_vs_ref"] < 1e-5 and got["triton_causal_vs_ref"] < 1e-5, got
    assert got["causal_mask_vs_ref"] > 1e-2, "a chain's causal mask attended as the tree does: the mask is not read"
