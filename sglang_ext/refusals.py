"""Every rule that refuses a model, a drafter, a setting or a request, in one place.

Three callers read them: the preflight (service/preflight.py, before SGLang starts, from the config and the models'
config.json files), the worker (worker.py, at start-up, from what SGLang built, for a server started without
dflash-serve) and the request path (patches/request_validation.py, each request's effective parameters). Each rule
returns why it refuses, ending with the fix (None: it serves); the caller names the field. The support matrix's
rows (which families and drafters are served) are data, in support.py; the rules that read them are here.
Pure: no torch, no SGLang.
"""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sglang_ext import names
from sglang_ext.support import DRAFTERS, MODELS_DOC, TARGETS

DFLASH_FIX = "serve this pair with speculative.algorithm: dflash"
DRAFTER_FIX = "use a drafter trained for this target"


# -- the model and the drafter -------------------------------------------------------------------------------------

def target_refusal(architecture: str | None, algorithm: str) -> str | None:
    """Why `algorithm` does not serve a target of this architecture (None: it serves). Plain decoding is SGLang's
    own and never refused here; upstream's `dflash` is refused only where its row says so (a family outside the
    matrix keeps upstream's own checks); `dflash_adaptive` serves the matrix's rows only."""
    if algorithm == "none":
        return None
    row = TARGETS.get(architecture or "")
    if row is not None:
        return row.refused.get(algorithm)
    if algorithm == "dflash_adaptive":
        return (f"target architecture {architecture} is not in the support matrix ({MODELS_DOC}): dflash_adaptive "
                f"has not been tested with it; serve it with speculative.algorithm: dflash")
    return None


def dtype_refusal(architecture: str | None, served: str, checkpoint: str | None) -> str | None:
    """Why the target cannot run in the served dtype (None: it can). gpt-oss builds its attention projections in
    the checkpoint's dtype (models/gpt_oss.py GptOssAttention params_dtype=config.dtype), so serving a bf16
    checkpoint in another dtype fails at the first forward with mismatched matmul dtypes."""
    row = TARGETS.get(architecture or "")
    if row is None or not row.checkpoint_dtype_params or served == "auto" or checkpoint in (None, served):
        return None
    return (f"{architecture} runs its attention projections in the checkpoint's dtype {checkpoint}, not "
            f"{served}: set model.dtype: {checkpoint} (or auto)")


def drafter_refusal(architecture: str | None, algorithm: str) -> str | None:
    """Why `algorithm` does not serve a drafter of this architecture (None: it serves); upstream's `dflash` keeps
    its own checks."""
    if algorithm != "dflash_adaptive":
        return None
    arch = architecture or "DFlashDraftModel"  # none named: read as the plain drafter; SGLang's loader decides
    if arch not in DRAFTERS:
        return (f"drafter architecture {arch} is not in the support matrix ({MODELS_DOC}): dflash_adaptive has not "
                f"been tested with it; serve it with speculative.algorithm: dflash")
    why = DRAFTERS[arch]
    return None if why is None else f"drafter architecture {arch}: {why}; serve it with speculative.algorithm: dflash"


def drafter_head_refusal(lilicorr: bool, domino: bool) -> str | None:
    """Why dflash_adaptive does not serve a drafter whose head proposes otherwise than DFlash's and DFlash2's
    (known once SGLang loaded it: the worker's rule)."""
    if not (lilicorr or domino):
        return None
    return f"supports DFlash and DFlash2 drafters; this drafter has a LiLiCorr/Domino head: {DFLASH_FIX}"


def drafter_layout_refusal(cfg: Mapping[str, Any]) -> str | None:
    """Why SGLang's DFlash loader (srt/models/dflash.py, srt/speculative/dflash_utils.py) cannot build a drafter
    from this config.json (None: it can), read as the loader reads it: ``layer_types`` an entry for every draft
    layer, each full or sliding attention, a sliding layer needing ``sliding_window``; DFlash2's convolution needs
    ``conv_kernel_size`` and ``conv_group_size`` together, the group size dividing ``hidden_size``; its selector
    ``selector_rank`` and ``selector_top_k`` together. Both published z-lab layouts pass (docs/MODELS.md)."""
    dflash = cfg.get("dflash_config") or {}
    n = cfg.get("num_hidden_layers")
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or (isinstance(n, int) and len(types) < n):
            return (f"layer_types must list one attention type per draft layer ({n}), got {types!r}; "
                    f"{DRAFTER_FIX}")
        odd = sorted({t for t in types[:n] if t not in ("full_attention", "sliding_attention")})
        if odd:
            return f"layer_types {odd}: a DFlash drafter's layers are full_attention or sliding_attention"
        # Nemotron 3.5's drafts give the window as dflash_config.swa_window_size (dflash_utils reads it there)
        if "sliding_attention" in types[:n] and not (cfg.get("sliding_window") or dflash.get("swa_window_size")):
            return "layer_types has sliding_attention layers but config.json sets no sliding_window"
    taps, group = dflash.get("conv_kernel_size") or 0, dflash.get("conv_group_size") or 0
    if bool(taps) != bool(group):
        return (f"dflash_config.conv_kernel_size ({taps}) and conv_group_size ({group}) go together: the "
                f"drafter's grouped convolution needs both")
    hidden = cfg.get("hidden_size")
    if group and isinstance(hidden, int) and hidden % int(group):
        return f"dflash_config.conv_group_size {group} does not divide hidden_size {hidden}"
    if bool(dflash.get("selector_rank")) != bool(dflash.get("selector_top_k")):
        return (f"dflash_config.selector_rank ({dflash.get('selector_rank')}) and selector_top_k "
                f"({dflash.get('selector_top_k')}) go together: the drafter's candidate selector needs both")
    return None


def last_layer_refusal(architecture: str | None, layer_ids: list[int], n_layers: int) -> str | None:
    """Why these draft feature layers cannot be captured (None: they can). SGLang captures target layer k's output
    as the input of layer k + 1, so most models never see k = n - 1: Qwen3-MoE's index fails at start-up, the
    dense models capture one feature short and the drafter's fc layer fails on it in the first forward."""
    row = TARGETS.get(architecture or "")
    if n_layers - 1 not in layer_ids or (row is not None and row.last_layer_capture):
        return None
    return (f"dflash_config.target_layer_ids {layer_ids} include the target's last layer {n_layers - 1}, whose "
            f"output SGLang does not capture for {architecture}; use a drafter whose layers are 0..{n_layers - 2}")


def hidden_size_refusal(drafter: int, target: int) -> str | None:
    """Why a drafter's hidden size does not fit the target (its features are the target's hidden states)."""
    if drafter == target:
        return None
    return (f"drafter hidden_size {drafter} does not match the target's {target} (model.path); this drafter was "
            f"trained for another model: {DRAFTER_FIX}")


def vocab_size_refusal(drafter: int, target: int) -> str | None:
    """Why a drafter's vocabulary does not fit the target (it proposes the target's token ids)."""
    if drafter == target:
        return None
    return (f"drafter vocab_size {drafter} does not match the target's {target} (model.path); drafter and target "
            f"must share a tokenizer: {DRAFTER_FIX}")


def layer_ids_refusal(layer_ids: Sequence[int], n_layers: int) -> str | None:
    """Why a drafter's feature layers are not the target's (an index past the target's layers)."""
    bad = [i for i in layer_ids if not 0 <= i < n_layers]
    if not bad:
        return None
    return (f"dflash_config.target_layer_ids {bad} out of range for a target with {n_layers} layers (valid: "
            f"0..{n_layers - 1}); {DRAFTER_FIX}")


def mask_token_refusal(mask: Any, vocab: int) -> str | None:
    """Why a drafter's mask token cannot be embedded by the target (outside its vocabulary)."""
    if mask is None or (isinstance(mask, int) and 0 <= mask < vocab):
        return None
    return f"dflash_config.mask_token_id {mask} is outside the target vocabulary (0..{vocab - 1}); {DRAFTER_FIX}"


def fc_shape_refusal(fc: list[int] | None, hidden: int, n_layers: int) -> str | None:
    """Why a drafter's fc layer cannot read the target's features (one hidden state per feature layer)."""
    if fc is None or fc == [hidden, n_layers * hidden]:
        return None
    return (f"fc.weight has shape {fc}, expected [{hidden}, {n_layers * hidden}] for {n_layers} target layers of "
            f"hidden size {hidden}; {DRAFTER_FIX}")


# -- settings --------------------------------------------------------------------------------------------------------

def block_size_refusal(block: int, draft_block: int) -> str | None:
    """Why a verify block wider than the drafter's trained block cannot be served by DFlash."""
    if block <= draft_block:
        return None
    return (f"{block} is larger than the drafter's trained block_size {draft_block}; use a value in "
            f"2..{draft_block}")


def tokenizer_workers_refusal(workers: Any) -> str | None:
    """Why more than one tokenizer worker is refused: SGLang 0.5.23 adds its API-key middleware only in
    single-tokenizer mode (http_server.py ``_setup_and_run_http_server``); its workers load the app in processes of
    their own, where dflash-serve's HTTP guard (sglang_ext/patches/http_guard.py) was never tested. Retired when
    SGLang keys every tokenizer worker and a multi-worker server passes tests/integration/test_admin_key.py."""
    try:
        n = int(workers if workers is not None else 1)
    except (TypeError, ValueError):
        return None  # not a number: SGLang's own parser refuses it (sglang_args)
    if n <= 1:
        return None
    return (f"{n} tokenizer workers are refused: SGLang checks no API key with more than one tokenizer worker, "
            f"so every route, admin routes included, would be open to anybody who reaches the port; remove it (1)")


def watermark_refusal(enabled: bool) -> str | None:
    """Why DFlash does not serve SGLang's watermark: its verify never applies it, so outputs would carry none."""
    if not enabled:
        return None
    return ("DFlash's verify does not apply SGLang's watermark, so outputs would silently carry none; serve "
            "watermarked traffic with speculative.algorithm: none")


def block_verification_refusal(enabled: bool, device: str, selector: bool) -> str | None:
    """Why block verification cannot serve a DFlash2 drafter's path on CPU."""
    if not (enabled and device == "cpu" and selector):
        return None
    return ("on CPU a DFlash2 drafter's path is verified token by token (exact; sglang_ext/cpu/sampling.py), and "
            "block verification has no CPU sampler: unset it on CPU")


# Why dflash_adaptive refuses a drafter served with a draft window (upstream's `dflash` serves it): the adaptive
# steps write and read the draft KV at the target's own req_to_token slots (steps/window.py, steps/draft_kv.py),
# which the compact window replaces with a draft-local view rebuilt from committed state each iteration.
DRAFT_WINDOW_REFUSAL = ("dflash_adaptive does not serve a draft window: its steps keep the draft KV at the "
                        "target's own KV slots, which the compact window replaces; unset "
                        "sglang_args.speculative_draft_window_size or serve with speculative.algorithm: dflash")


def draft_window_refusal(window: int | None, algorithm: str) -> str | None:
    """Why this algorithm does not serve the configured draft window (None: it serves, or none is set)."""
    return DRAFT_WINDOW_REFUSAL if window is not None and algorithm == "dflash_adaptive" else None


def dp_attention_refusal(enabled: bool) -> str | None:
    """Why dflash_adaptive does not serve data-parallel attention (its decision is broadcast over one TP group)."""
    return f"does not support data-parallel attention: {DFLASH_FIX}" if enabled else None


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


def deployment_trees_refusal(widths: Sequence[int], block: int, *, device: str, tp_size: int, page_size: int,
                             attention_backend: str | None, hybrid: bool, selector: bool) -> str | None:
    """The preflight's whole rule for tree candidates ``widths`` (above the drafter's ``block``), from the config:
    a hybrid target or a DFlash2 drafter first, then the deployment (tensor parallelism, paging, a GPU's opt-in
    and attention backend). The worker applies the same parts as each becomes known at start-up."""
    if not widths:
        return None
    why = (hybrid_tree_refusal() if hybrid else None) or (selector_tree_refusal() if selector else None)
    why = why or tree_refusal(device, tp_size, page_size)
    if why is None and device != "cpu":
        why = tree_attention_refusal(attention_backend, page_size)
    return None if why is None else tree_widths_error(widths, block, why)


def deployment_per_request_widths_refusal(device: str, *, hybrid: bool, selector: bool) -> str | None:
    """The preflight's whole rule for ``per_request_widths`` on: the target, the drafter, then the device."""
    if hybrid:
        return hybrid_per_request_widths_refusal()
    if selector:
        return selector_per_request_widths_refusal()
    return per_request_widths_refusal(device)


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


# -- requests ------------------------------------------------------------------------------------------------------
# Sampling DFlash cannot serve as plain decoding would, judged on a request's effective parameters (after SGLang
# merged the operator's defaults) and on the defaults themselves at start-up (the operator's
# `preferred_sampling_params`, the model's generation_config.json). Why each: DFlash's rejection sampler draws its
# own coins, so a `sampling_seed` at temperature > 0 would not reproduce the seeded samples; under the overlap
# scheduler the next step launches before this step's tokens reach the penalizers, so penalties and
# `min_new_tokens` would see stale counts (patches/verify_sampling.py makes every other sampling parameter lossless).

DFLASH_FAMILY = ("DFLASH", "DFLASH_ADAPTIVE")
PENALTIES = (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0),
             ("min_new_tokens", 0))
OVERLAP_FIX = "set sglang_args.disable_overlap_schedule: true"


@dataclass(frozen=True)
class Lossy:
    """A parameter DFlash would serve differently: `why` completes "<param> ...", `server_fix` is what the
    operator can change instead of dropping the parameter (None: nothing)."""

    param: str
    why: str
    server_fix: str | None = None


def is_dflash(algorithm: Any) -> bool:
    return str(algorithm or "").upper() in DFLASH_FAMILY


def lossy_sampling(params: Mapping[str, Any], overlap: bool) -> Lossy | None:
    """The first parameter of `params` (SGLang's sampling-parameter names) DFlash would not serve losslessly;
    `overlap`: the server runs SGLang's overlap scheduler."""
    temperature = params.get("temperature", 1.0)
    if params.get("sampling_seed") is not None and (temperature is None or temperature > 0):
        return Lossy("sampling_seed", "is not supported with DFlash speculative decoding at temperature > 0 (its "
                                      "rejection sampler would not reproduce the seeded samples)")
    if overlap:
        for name, neutral in PENALTIES:
            value = params.get(name)
            if value is not None and value != neutral:
                return Lossy(name, "is not served losslessly by DFlash under the overlap scheduler", OVERLAP_FIX)
    return None


def request_sampling_refusal(params: Mapping[str, Any], overlap: bool) -> str | None:
    """Why a request's effective sampling parameters are refused (a 400 naming the parameter), with the fix."""
    lossy = lossy_sampling(params, overlap)
    if lossy is None:
        return None
    fix = f"{lossy.server_fix} on the server, or drop {lossy.param}" if lossy.server_fix else f"drop {lossy.param}"
    return f"{lossy.param} {lossy.why}; {fix}"


def sampling_defaults_refusal(params: Mapping[str, Any], overlap: bool, *, from_model: bool,
                              remove: str) -> str | None:
    """Why defaults every request inherits (the operator's, or the model's generation config: ``from_model``)
    are refused at start-up rather than on every request; ``remove``: how to drop them."""
    lossy = lossy_sampling(params, overlap)
    if lossy is None:
        return None
    where = "its generation_config.json sets" if from_model else "sets"
    fix = f"{lossy.server_fix}, or {remove}" if lossy.server_fix else remove
    return f"{where} {lossy.param} {params[lossy.param]!r} for every request; {lossy.param} {lossy.why}; {fix}"


def custom_logit_processor_refusal(algorithm: Any, processor: Any) -> str | None:
    """Why DFlash refuses a request's custom logit processor: the verify runs every row of a block at once, so rows
    after the first would not see the tokens before them."""
    if not (is_dflash(algorithm) and processor):
        return None
    return ("custom_logit_processor is not supported with DFlash speculative decoding (its verify rows would not "
            "see the tokens before them); serve this request without speculation")
