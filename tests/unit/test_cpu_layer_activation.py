"""The CPU layer changes SGLang only when asked (DFLASH_SERVE_CPU=1), and then fully."""
from __future__ import annotations

from tests.conftest import child_result

PROBE = r"""
import json, os, sys, torch
hook_ran = "sgl_kernel" in sys.modules or any(type(f).__name__ == "_StubFinder" for f in sys.meta_path)
if not os.environ.get("DFLASH_SERVE_CPU"):
    # This machine lacks torchvision/sgl_kernel, which a GPU machine has; only the import stubs
    # stand in for them here, so SGLang imports. No patch comes with them.
    from sglang_ext.cpu import stubs
    stubs.install()
before = set(sys.modules)
import sglang_ext.plugin as plugin
plugin.register()
registered_imports = sorted(m for m in set(sys.modules) - before if m.startswith(("sglang.", "prometheus_client")))
from sglang.srt.layers.attention import torch_native_backend as tnb
from sglang.srt.speculative import dflash_utils as du
from sglang.srt.models import dflash as dm
from sglang.srt.arg_groups import speculative_hook as sh, choices
out = {
    "hook_ran_at_startup": hook_ran,
    "registered_imports": registered_imports,
    "attn_patched": tnb.TorchNativeAttnBackend.forward_extend.__module__.startswith("sglang_ext"),
    "decode_patched": tnb.TorchNativeAttnBackend.forward_decode.__module__.startswith("sglang_ext"),
    "sampler_available": du.is_dflash_sampling_verify_available(),
    "handle_dflash_patched": hasattr(sh._handle_dflash, "__wrapped__"),
    "draft_backend_choice": "torch_native" in choices.DRAFT_ATTENTION_BACKEND_CHOICES,
    "record_stream_patched": (getattr(torch.Tensor.record_stream, "__module__", None) or "").startswith("sglang_ext"),
    "kernels_bound": getattr(sys.modules["sgl_kernel"], "assign_req_to_token_pool_cpu", None).__module__,
    # DFlash2's selector and convolutions: torch.compile's wrappers, or (CPU layer) the functions they wrap
    "dflash2_ops_eager": not any(hasattr(getattr(dm, n), "_torchdynamo_orig_callable")
                                 for n in ("_score_edges", "_follow_maps", "_grouped_conv")),
    "draft_probs_sampler": __import__("sglang.kernels.ops.speculative.dspark.dspark_accept",
                                      fromlist=["x"]).chain_speculative_sampling_triton.__module__,
}
try:
    import sgl_kernel
    sgl_kernel.fused_add_rmsnorm(1, 2)
except Exception as e:
    out["stub_call"] = f"{type(e).__name__}: {e}"
try:
    import sgl_kernel.scalar_type  # must stay missing so SGLang's ImportError fallback runs
    out["scalar_type"] = "imported"
except ImportError:
    out["scalar_type"] = "ImportError"
print("RESULT" + json.dumps(out))
"""


def probe(active: bool) -> dict:
    return child_result("-c", PROBE, cpu_layer=active)


def test_inactive_without_the_environment_variable():
    out = probe(active=False)
    assert out["hook_ran_at_startup"] is False
    assert out["registered_imports"] == []
    assert out["kernels_bound"] == "sglang_ext.cpu.stubs"  # raising stubs only: no CPU kernels bound
    assert not any(out[k] for k in ("attn_patched", "decode_patched", "sampler_available", "handle_dflash_patched",
                                    "draft_backend_choice", "record_stream_patched", "dflash2_ops_eager"))
    assert not out["draft_probs_sampler"].startswith("sglang_ext")


def test_active_with_the_environment_variable():
    out = probe(active=True)
    assert out["hook_ran_at_startup"] is True  # the .pth hook, before any sglang import
    assert out["kernels_bound"] == "sglang_ext.cpu.kernels"
    # register() defers every patch to import time: it must not import SGLang or prometheus_client
    # itself (main process: that would break SGLang's multiprocess metrics).
    assert out["registered_imports"] == []
    assert all(out[k] for k in ("attn_patched", "decode_patched", "sampler_available", "handle_dflash_patched",
                                "draft_backend_choice", "record_stream_patched", "dflash2_ops_eager"))
    assert out["draft_probs_sampler"].startswith("sglang_ext")
    assert out["stub_call"].startswith("MissingKernelError: sgl_kernel.fused_add_rmsnorm was called")
    assert out["scalar_type"] == "ImportError"
