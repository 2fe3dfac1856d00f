"""The rules that refuse a DFLASH_ADAPTIVE setting a deployment cannot serve, in one place.

Both sides read them: the preflight (service/preflight.py, before SGLang starts, from the config) and the worker
(at start-up, from what SGLang built, for a server started without dflash-serve). Each rule returns why it refuses
(None: it serves); the caller names the field. Pure: no torch, no SGLang.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

from sglang_ext import names

# GPU attention backends whose eager TARGET_VERIFY reads DFlashVerifyInput.custom_mask in tree/mask.py's packed
# layout, by sglang_args.attention_backend name -> the class SGLang builds: FlashInfer (the mask goes into the verify
# prefill wrapper's plan) and Triton (extend attention, mask_indptr = n * (seq_lens + n) per request).
# Pinned: tests/unit/test_gpu_contracts.py.
TREE_MASK_BACKENDS = {"flashinfer": "FlashInferAttnBackend", "triton": "TritonAttnBackend"}


def tree_refusal(device: str, tp_size: int, page_size: int) -> str | None:
    """Why this deployment cannot verify a tree whatever its attention backend (None: it can). ``device``: "cpu"
    or a GPU type such as "cuda"; ``page_size``: the KV page size (sglang_args.page_size)."""
    if tp_size != 1:
        return f"needs tensor parallel size 1, not {tp_size} (the draft marginals read the whole LM head)"
    why = _page_refusal(page_size)
    if why is not None:
        return why
    if device == "cpu":
        return None
    if os.environ.get(names.GPU_TREES) != "1":
        return f"has not served on a GPU yet (set {names.GPU_TREES}=1 to run it on device {device})"
    return None


def tree_attention_refusal(backend: str | None, page_size: int) -> str | None:
    """Why a GPU target cannot verify a tree with this attention (None: it can). ``backend``: the
    sglang_args.attention_backend name or the class SGLang built (None: not chosen yet; the worker checks the
    class)."""
    if backend is not None and backend not in TREE_MASK_BACKENDS and backend not in TREE_MASK_BACKENDS.values():
        known = " or ".join(TREE_MASK_BACKENDS)
        return (f"on GPU needs an attention backend that reads the tree's mask ({known}), not {backend}: set "
                f"sglang_args.attention_backend to {known}")
    return _page_refusal(page_size)


def _page_refusal(page_size: int) -> str | None:
    # on every device: the commit remaps the walked path's slots one by one in req_to_token, which a paged pool
    # (slots allocated and freed by whole pages) cannot hold
    if page_size != 1:
        return f"needs KV page size 1, not {page_size}: unset sglang_args.page_size"
    return None


def tree_widths_error(widths: Sequence[int], block: int, why: str) -> str:
    """The refusal of tree candidates, naming the field and the fix."""
    return (f"speculative.adaptive.candidates: widths {list(widths)} are above the drafter's block {block}, so they "
            f"verify a DDTree, which {why}; use widths up to {block}")


def per_request_widths_refusal(device: str) -> str | None:
    """Why ``per_request_widths`` cannot run on this device (None: it can)."""
    if device == "cpu":
        return None
    return (f"runs on CPU only in this release (the ragged verify reads the CPU attention's layout; GPU verify "
            f"graphs are per width), not device {device}; set it false")


# Layer kinds of a hybrid target's config.json `layer_types` that carry a recurrent state instead of a KV cache
# (Qwen3.5 / Qwen3-Next gated delta net, mamba layers): what the preflight reads; the worker asks SGLang.
RECURRENT_LAYER_KINDS = frozenset({"linear_attention", "mamba", "mamba2", "gated_delta_net"})
HYBRID_FIX = "use widths up to the drafter's block (a chain), or serve this pair with speculative.algorithm: dflash"


def is_hybrid_target(config: dict) -> bool:
    """Whether a target's config.json (or its `text_config`) declares recurrent-state layers."""
    for cfg in (config, config.get("text_config") or {}):
        if RECURRENT_LAYER_KINDS & set(cfg.get("layer_types") or ()):
            return True
        if cfg.get("full_attention_interval") and cfg.get("linear_num_value_heads"):
            return True
    return False


def hybrid_tree_refusal() -> str:
    """Why a hybrid target cannot verify a DDTree."""
    return ("has a hybrid target (gated-delta-net or mamba layers): the verify writes one recurrent state per chain "
            "position and commits the accepted prefix's, and a tree needs a state per node, which is not built")


def hybrid_per_request_widths_refusal() -> str:
    """Why a hybrid target cannot verify a width per request."""
    return ("the target is hybrid (gated-delta-net or mamba layers): its recurrent-state verify reads one width for "
            "the whole batch, and a ragged verify packs several; set it false")


def hybrid_device_refusal(device: str) -> str | None:
    """Why a hybrid target cannot be served by dflash_adaptive on this device (None: it can)."""
    if device == "cpu":
        return None
    return (f"a hybrid target (gated-delta-net or mamba layers) has served under dflash_adaptive on CPU only: its "
            f"per-width verify CUDA graphs with the recurrent-state buffers have not run on device {device} yet; "
            f"serve this pair with speculative.algorithm: dflash")


def selector_tree_refusal() -> str:
    """Why a DFlash2 (candidate-selector) drafter cannot verify a DDTree."""
    return ("cannot take a DFlash2 drafter: its candidate selector proposes one path, and a tree built from the "
            "selector's top-k candidates with its pairwise scores is not built (a tree from the backbone's "
            "marginals would verify proposals the drafter was not trained to make)")


def selector_per_request_widths_refusal() -> str:
    """Why a DFlash2 (candidate-selector) drafter cannot draft a width per request."""
    return ("the drafter is DFlash2: its convolutions run across a whole block and its selector walks one block "
            "per request, and a ragged step packs blocks of several widths; set it false")
