"""The GPU verify resources' rules that run here (sglang_ext/verify_runtimes.py): which backend and graph a width's
verify gets, what a tree width's graph is captured with, and which GPU targets may verify a tree.

Capture itself needs a GPU (tests/gpu); these are the decisions around it. Every width gets its own backend and
graph; a tree width's graph must be captured with the runner's custom-mask buffer, where upstream captures DFLASH
verify on FlashInfer and Triton without one (a graph so captured would attend causally over the tree): checked on
upstream's own ``DecodeCudaGraphRunner.get_spec_info``. Which targets may verify a tree: resolved by upstream's
own ``resolve_dflash_verify_mask_policy`` on SGLang's real backend classes. Both in a child process with the CPU
layer's import stubs; what replay does with the mask is pinned in tests/unit/test_gpu_contracts.py.
"""
from __future__ import annotations

from types import SimpleNamespace

from sglang_ext.verify_runtimes import VerifyRuntime, VerifyRuntimes, tree_capture_sizes
from tests.conftest import child_result

B = 16


def test_each_width_gets_its_own_graph_and_an_uncaptured_width_the_start_up_backend():
    start, eight = VerifyRuntime(B, "backend-16", "graphs-16"), VerifyRuntime(8, "backend-8", "graphs-8")
    tree = VerifyRuntime(32, "backend-32", "graphs-32")  # a tree of 31 nodes
    runner = SimpleNamespace(attn_backend=start.attn_backend, decode_cuda_graph_runner=start.graph_runner)
    runtimes = VerifyRuntimes(runner, {B: start, 8: eight, 32: tree}, startup_width=B)
    assert runtimes.extra_widths == [8, 32]
    runtimes.activate(8)
    assert (runner.attn_backend, runner.decode_cuda_graph_runner) == ("backend-8", "graphs-8")
    runtimes.activate(32)
    assert (runner.attn_backend, runner.decode_cuda_graph_runner) == ("backend-32", "graphs-32")
    runtimes.activate(64)  # not captured: the start-up backend, whose runner refuses the width (eager)
    assert (runner.attn_backend, runner.decode_cuda_graph_runner) == ("backend-16", "graphs-16")
    runtimes.activate(8)
    assert runner.attn_backend == "backend-8"
    eager = SimpleNamespace(attn_backend="cpu", decode_cuda_graph_runner=None)
    VerifyRuntimes.eager(eager).activate(64)
    assert eager.attn_backend == "cpu"  # one backend serves every width: nothing to swap


def test_a_tree_width_is_captured_only_at_batch_sizes_whose_rows_fit_the_shared_logits_buffer():
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    rows = 256 * B  # SGLang sizes it for the published width B at the largest captured batch size
    assert tree_capture_sizes(sizes, 32, rows) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert tree_capture_sizes(sizes, 64, rows) == [1, 2, 4, 8, 16, 32, 64]
    assert tree_capture_sizes([4, 1, 2, 4], 64, 64) == [1]  # sorted, once each
    assert tree_capture_sizes(sizes, 64, 48) == []  # none fits: the width verifies eagerly


SIZES_PROBE = r"""
import json
from types import SimpleNamespace
from sglang.srt.model_executor.cuda_graph_config import CudaGraphConfig, PhaseConfig
from sglang.srt.model_executor.runner.base_cuda_graph_runner import get_batch_sizes_to_capture
from sglang.srt.runtime_context import get_context
from sglang.srt.server_args import ServerArgs
from sglang_ext.verify_runtimes import published_capture_sizes

args = ServerArgs(model_path="models/tiny-code/target", device="cpu")
get_context().set_server_args(args)
get_context().override("test", cuda_graph_config=CudaGraphConfig(decode=PhaseConfig(backend="full",
                                                                                    bs=[1, 2, 4, 8, 16, 32, 64])))
runner = SimpleNamespace(req_to_token_pool=SimpleNamespace(size=64), server_args=args)
sizes = lambda width: get_batch_sizes_to_capture(runner, width, gathered_buffer_required=False)[0]
with published_capture_sizes([1, 2, 4]):
    inside = sizes(64)
print("RESULT" + json.dumps({"inside": inside, "after": sizes(16)}))
"""


def test_a_tree_runner_reads_the_batch_sizes_published_for_its_capture_and_the_rest_the_full_list():
    got = child_result("-c", SIZES_PROBE)  # upstream's own reader of the batch sizes a runner captures
    assert got == {"inside": [1, 2, 4], "after": [1, 2, 4, 8, 16, 32, 64]}


CAPTURE_PROBE = r"""
import json
from types import SimpleNamespace
import torch
from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend
from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
from sglang.srt.model_executor.runner import DecodeCudaGraphRunner
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang_ext.verify_runtimes import tree_graph_runner_class

def capture_input(cls, backend_cls):
    runner = object.__new__(cls)  # the attributes get_spec_info reads; __init__ would capture on a GPU
    runner.model_runner = SimpleNamespace(spec_algorithm=SpeculativeAlgorithm.DFLASH, is_draft_worker=False,
                                          attn_backend=object.__new__(backend_cls))
    runner.buffers = SimpleNamespace(custom_mask=torch.ones(8, dtype=torch.bool))
    runner.captured_req_width, runner.ragged_verify_mode = 32, False
    info = runner.get_spec_info(num_tokens=64)
    return {"mask_is_buffer": info.custom_mask is runner.buffers.custom_mask, "width": info.draft_token_num,
            "hidden": info.capture_hidden_mode.name}

tree, backends = tree_graph_runner_class(), (FlashInferAttnBackend, TritonAttnBackend)
print("RESULT" + json.dumps({
    "subclass": issubclass(tree, DecodeCudaGraphRunner) and tree_graph_runner_class() is tree,
    "upstream": {b.__name__: capture_input(DecodeCudaGraphRunner, b) for b in backends},
    "tree": {b.__name__: capture_input(tree, b) for b in backends}}))
"""


def test_a_tree_width_is_captured_with_the_custom_mask_buffer_upstream_leaves_out():
    got = child_result("-c", CAPTURE_PROBE)
    assert got["subclass"]
    for backend in ("FlashInferAttnBackend", "TritonAttnBackend"):
        # upstream's own capture input for DFLASH on these backends has no mask: a chain graph, causal
        assert got["upstream"][backend] == {"mask_is_buffer": False, "width": 32, "hidden": "FULL"}
        assert got["tree"][backend] == {"mask_is_buffer": True, "width": 32, "hidden": "FULL"}


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
    assert got["torch_native"] == ("on GPU needs an attention backend that reads the tree's mask (flashinfer or "
                                   "triton), not TorchNativeAttnBackend: set sglang_args.attention_backend to "
                                   "flashinfer or triton")
    assert got["triton_paged"] == "needs KV page size 1, not 16: unset sglang_args.page_size"
