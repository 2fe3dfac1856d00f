"""The GPU verify resources' rules that run here (sglang_ext/verify_runtimes.py): which backend and graph a width's
verify gets, and which GPU targets may verify a tree.

Capture itself needs a GPU (tests/gpu); these are the decisions around it. A tree width has no graph: it must get
the start-up width's backend and runner, whose graph refuses any other width, so the tree verifies eagerly with
its mask (pinned to upstream in tests/unit/test_gpu_contracts.py). Which targets may: resolved by upstream's own
``resolve_dflash_verify_mask_policy`` on SGLang's real backend classes, in a child process with the CPU layer's
import stubs.
"""
from __future__ import annotations

from types import SimpleNamespace

from sglang_ext.verify_runtimes import VerifyRuntime, VerifyRuntimes
from tests.conftest import child_result

B = 16


def test_each_chain_width_gets_its_own_graph_and_a_tree_width_the_start_up_backend_eagerly():
    start, eight = VerifyRuntime(B, "backend-16", "graphs-16"), VerifyRuntime(8, "backend-8", "graphs-8")
    runner = SimpleNamespace(attn_backend=start.attn_backend, decode_cuda_graph_runner=start.graph_runner)
    runtimes = VerifyRuntimes(runner, {B: start, 8: eight}, startup_width=B)
    assert runtimes.extra_widths == [8]
    runtimes.activate(8)
    assert (runner.attn_backend, runner.decode_cuda_graph_runner) == ("backend-8", "graphs-8")
    runtimes.activate(32)  # a tree of 31 nodes
    assert (runner.attn_backend, runner.decode_cuda_graph_runner) == ("backend-16", "graphs-16")
    runtimes.activate(8)
    assert runner.attn_backend == "backend-8"
    eager = SimpleNamespace(attn_backend="cpu", decode_cuda_graph_runner=None)
    VerifyRuntimes.eager(eager).activate(64)
    assert eager.attn_backend == "cpu"  # one backend serves every width: nothing to swap


PROBE = r"""
import json
from types import SimpleNamespace
from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from sglang_ext.verify_runtimes import tree_verify_refusal

def refusal(cls, page_size=1):
    return tree_verify_refusal(SimpleNamespace(attn_backend=object.__new__(cls), page_size=page_size))

print("RESULT" + json.dumps({"flashinfer": refusal(FlashInferAttnBackend), "triton": refusal(TritonAttnBackend),
                             "torch_native": refusal(TorchNativeAttnBackend),
                             "triton_paged": refusal(TritonAttnBackend, 16)}))
"""


def test_a_gpu_tree_needs_an_attention_backend_that_reads_its_mask_and_page_size_1():
    got = child_result("-c", PROBE)
    assert got["flashinfer"] is None and got["triton"] is None
    assert got["torch_native"] == ("needs a target attention backend that reads a custom verify mask "
                                   "(FlashInferAttnBackend, TritonAttnBackend), not TorchNativeAttnBackend: set "
                                   "sglang_args.attention_backend to flashinfer or triton")
    assert got["triton_paged"] == "needs KV page size 1, not 16: unset sglang_args.page_size"
