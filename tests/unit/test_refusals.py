"""sglang_ext/refusals.py, the one home of every refusal: each message ends with its fix, and the module loads
without torch or SGLang (the preflight runs it before either is imported)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from sglang_ext import refusals as r

# the last clause of every message says what to do: an imperative after a ';', ':' or ',', no clause after it
FIX = re.compile(r"[;:,] (?:or )?(?:use|set|unset|serve|remove|drop)\b(?:(?!; ).)*$")

MESSAGES = {
    "target": r.target_refusal("NoSuchForCausalLM", "dflash_adaptive"),
    "dtype": r.dtype_refusal("GptOssForCausalLM", "float32", "bfloat16"),
    "drafter": r.drafter_refusal("NoSuchDraftModel", "dflash_adaptive"),
    "drafter_head": r.drafter_head_refusal(lilicorr=True, domino=False),
    "last_layer": r.last_layer_refusal("Qwen3ForCausalLM", [0, 3], 4),
    "hidden_size": r.hidden_size_refusal(512, 256),
    "vocab_size": r.vocab_size_refusal(5000, 4096),
    "layer_ids": r.layer_ids_refusal([0, 9], 4),
    "mask_token": r.mask_token_refusal(99999, 4096),
    "fc_shape": r.fc_shape_refusal([256, 512], 256, 3),
    "block_size": r.block_size_refusal(32, 16),
    "watermark": r.watermark_refusal(True),
    "block_verification": r.block_verification_refusal(True, "cpu", selector=True),
    "draft_window": r.draft_window_refusal(32, "dflash_adaptive"),
    "dp_attention": r.dp_attention_refusal(True),
    "per_request_widths": r.per_request_widths_refusal("cuda"),
    "hybrid_device": r.hybrid_device_refusal("cuda"),
    "hybrid_per_request_widths": r.hybrid_per_request_widths_refusal(),
    "selector_per_request_widths": r.selector_per_request_widths_refusal(),
    "tree_attention": r.tree_attention_refusal("fa3", 1),
    **{f"trees_{name}": r.tree_widths_error([32], 16, why) for name, why in [
        ("tp", r.tree_refusal("cpu", 2, 1)), ("page", r.tree_refusal("cpu", 1, 16)),
        ("hybrid", r.hybrid_tree_refusal()), ("selector", r.selector_tree_refusal())]},
    "deployment_trees": r.deployment_trees_refusal([32], 16, device="cuda", tp_size=1, page_size=1,
                                                   attention_backend="fa3", hybrid=False, selector=False),
    "deployment_per_request_widths": r.deployment_per_request_widths_refusal("cpu", hybrid=True, selector=False),
    "request_seed": r.request_sampling_refusal({"sampling_seed": 1, "temperature": 0.7}, overlap=False),
    "request_penalty": r.request_sampling_refusal({"frequency_penalty": 0.5}, overlap=True),
    "defaults_penalty": r.sampling_defaults_refusal({"repetition_penalty": 1.1}, overlap=True, from_model=True,
                                                    remove="set sglang_args.sampling_defaults: openai"),
    "custom_logit_processor": r.custom_logit_processor_refusal("DFLASH", "a processor"),
}


@pytest.mark.parametrize("name", sorted(MESSAGES))
def test_every_message_ends_with_its_fix(name):
    message = MESSAGES[name]
    assert message is not None, f"{name}: the example is not refused"
    assert FIX.search(message), f"{name}: no fix at its end: {message!r}"


def test_what_serves_is_not_refused():
    assert r.target_refusal("Qwen3ForCausalLM", "dflash_adaptive") is None
    assert r.drafter_refusal("DFlash2DraftModel", "dflash_adaptive") is None
    assert r.drafter_head_refusal(lilicorr=False, domino=False) is None
    assert r.draft_window_refusal(32, "dflash") is None and r.draft_window_refusal(None, "dflash_adaptive") is None
    assert r.dp_attention_refusal(False) is None
    assert r.block_verification_refusal(True, "cuda", selector=True) is None
    assert r.hidden_size_refusal(256, 256) is None and r.mask_token_refusal(None, 4096) is None
    assert r.request_sampling_refusal({"frequency_penalty": 0.5}, overlap=False) is None
    assert r.custom_logit_processor_refusal("NONE", "a processor") is None
    assert r.deployment_trees_refusal([32], 16, device="cpu", tp_size=1, page_size=1, attention_backend=None,
                                      hybrid=False, selector=False) is None
    assert r.deployment_per_request_widths_refusal("cpu", hybrid=False, selector=False) is None


def test_it_loads_without_torch_or_sglang():
    code = ("import sys; import sglang_ext.refusals; "
            "print(sorted(m for m in ('torch', 'sglang', 'numpy') if m in sys.modules))")
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_SERVE_CPU"}  # its start-up hook imports torch
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "[]", out.stdout
