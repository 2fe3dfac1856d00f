"""Preflight: is the target servable, and does the drafter fit it? Fails fast, naming the field.

Runs before SGLang starts (which takes tens of seconds and then fails with a deep traceback, or --
for some mismatches -- silently: DFlash's weight loader ignores unknown tensor names).
Reads only config.json files and the safetensors header; imports neither torch nor sglang. Every rule that refuses
what it read is sglang_ext/refusals.py's (the worker and the request path call the same); this module reads the
files and names the field.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from service.config import ConfigError, Device, ServeConfig
from service.sglang_args import CPU_DEFAULTS, number
from sglang_ext import refusals, support

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


@dataclass(frozen=True)
class PreflightReport:
    target_layers: int
    hidden_size: int
    vocab_size: int
    draft_block_size: int | None
    block_size: int | None  # what will be verified per step
    target_layer_ids: tuple[int, ...] = ()


def _read_config(directory: Path, field: str) -> dict:
    if not directory.is_dir():
        raise ConfigError(f"{field}: directory not found: {directory}")
    cfg = directory / "config.json"
    if not cfg.is_file():
        raise ConfigError(f"{field}: no config.json in {directory} (expected a Hugging Face model directory)")
    try:
        data = json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{field}: {cfg} is not valid JSON: {e}") from None
    return data.get("text_config", data) | {k: v for k, v in data.items() if k == "dflash_config"}


def _architecture(directory: Path) -> str | None:
    """config.json `architectures[0]` (the model class SGLang loads), read after _read_config checked the file."""
    archs = json.loads((directory / "config.json").read_text()).get("architectures")
    return archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None


def _checkpoint_dtype(directory: Path) -> str | None:
    raw = json.loads((directory / "config.json").read_text())
    value = raw.get("dtype", raw.get("torch_dtype"))
    return value if isinstance(value, str) else None


def _safetensors_shapes(directory: Path) -> dict[str, list[int]]:
    """Tensor shapes from the safetensors header (8-byte length + JSON), without loading weights."""
    shapes: dict[str, list[int]] = {}
    for f in sorted(directory.glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        shapes |= {k: v["shape"] for k, v in header.items() if k != "__metadata__"}
    return shapes


def _get_int(cfg: dict, key: str, field: str, where: Path) -> int:
    value = cfg.get(key)
    if not isinstance(value, int):
        raise ConfigError(f"{field}: {where}/config.json has no integer {key!r}")
    return value


def check(config: ServeConfig) -> PreflightReport:
    target = _read_config(config.model.path, "model.path")
    tok_dir = config.model.tokenizer or config.model.path
    if not any((tok_dir / f).is_file() for f in _TOKENIZER_FILES):
        field = "model.tokenizer" if config.model.tokenizer else "model.path"
        raise ConfigError(f"{field}: no tokenizer files in {tok_dir} (set model.tokenizer to a tokenizer directory)")
    n_layers = _get_int(target, "num_hidden_layers", "model.path", config.model.path)
    hidden = _get_int(target, "hidden_size", "model.path", config.model.path)
    vocab = _get_int(target, "vocab_size", "model.path", config.model.path)
    for key in ("tokenizer_worker_num", "tokenizer-worker-num"):
        why = refusals.tokenizer_workers_refusal(config.sglang_args.get(key))
        if why is not None:
            raise ConfigError(f"sglang_args.{key}: {why}")
    spec = config.speculative
    arch = _architecture(config.model.path)
    why = refusals.target_refusal(arch, spec.algorithm)
    if why is not None:
        raise ConfigError(f"model.path: {why}")
    why = refusals.dtype_refusal(arch, config.model.dtype, _checkpoint_dtype(config.model.path))
    if why is not None:
        raise ConfigError(f"model.dtype: {why}")
    if spec.algorithm == "none":
        return PreflightReport(n_layers, hidden, vocab, None, None)

    for key in ("enable_watermark", "enable-watermark"):
        why = refusals.watermark_refusal(bool(config.sglang_args.get(key)))
        if why is not None:
            raise ConfigError(f"sglang_args.{key}: {why}")
    check_sampling_defaults(config)
    window = config.sglang_args.get("speculative_draft_window_size",
                                    config.sglang_args.get("speculative-draft-window-size"))
    why = refusals.draft_window_refusal(window, spec.algorithm)
    if why is not None:
        raise ConfigError(f"sglang_args.speculative_draft_window_size: {why}")
    where = spec.draft_model_path
    field = "speculative.draft_model_path"
    draft = _read_config(where, field)
    why = refusals.drafter_refusal(_architecture(where), spec.algorithm)
    if why is not None:
        raise ConfigError(f"{field}: {why}")
    block_verification = any(config.sglang_args.get(k) for k in ("speculative_use_block_verification",
                                                                   "speculative-use-block-verification"))
    why = refusals.block_verification_refusal(block_verification, config.server.device.value,
                                              support.is_selector_drafter(_architecture(where)))
    if why is not None:
        raise ConfigError(f"sglang_args.speculative_use_block_verification: {why}")
    if not list(where.glob("*.safetensors")):
        raise ConfigError(f"{field}: no *.safetensors weights in {where}")
    why = (refusals.hidden_size_refusal(_get_int(draft, "hidden_size", field, where), hidden)
           or refusals.vocab_size_refusal(_get_int(draft, "vocab_size", field, where), vocab))
    if why is not None:
        raise ConfigError(f"{field}: {why}")
    why = refusals.drafter_layout_refusal(draft)
    if why is not None:
        raise ConfigError(f"{field}: {why}")
    # read as SGLang's loader reads them (dflash_utils.parse_dflash_draft_config): dflash_config first, then the
    # top level -- z-lab's b16 drafters set block_size at the top level, its DFlash2 drafters inside dflash_config
    dflash = draft.get("dflash_config") or {}
    layer_ids = dflash.get("target_layer_ids", draft.get("target_layer_ids"))
    if not isinstance(layer_ids, list) or not layer_ids or not all(isinstance(i, int) for i in layer_ids):
        raise ConfigError(f"{field}: config.json needs dflash_config.target_layer_ids (a list of target layer indices)")
    why = (refusals.layer_ids_refusal(layer_ids, n_layers) or refusals.last_layer_refusal(arch, layer_ids, n_layers)
           or refusals.mask_token_refusal(dflash.get("mask_token_id", draft.get("mask_token_id")), vocab))
    if why is not None:
        raise ConfigError(f"{field}: {why}")
    draft_block = dflash.get("block_size", draft.get("block_size"))
    if not isinstance(draft_block, int) or draft_block < 2:
        raise ConfigError(f"{field}: config.json needs an integer block_size >= 2 (the drafter's trained block)")
    block = spec.block_size or draft_block
    why = refusals.block_size_refusal(block, draft_block)
    if why is not None:
        raise ConfigError(f"speculative.block_size: {why}")
    if spec.algorithm == "dflash_adaptive":
        _check_adaptive(spec, draft_block, config.server.device.value, config.sglang_args,
                        hybrid=refusals.is_hybrid_target(target),
                        selector=support.is_selector_drafter(_architecture(where)))
    why = refusals.fc_shape_refusal(_safetensors_shapes(where).get("fc.weight"), hidden, len(layer_ids))
    if why is not None:
        raise ConfigError(f"{field}: {why}")
    return PreflightReport(n_layers, hidden, vocab, draft_block, block, tuple(layer_ids))


def _check_adaptive(spec, draft_block: int, device: str, sglang_args: dict, hybrid: bool = False,
                    selector: bool = False) -> None:
    """The controller settings against the drafter (widths <= 4x its block; trees above it without tensor
    parallelism, with page size 1, on GPU with an attention backend that reads the tree's mask, and never for a
    ``hybrid`` target or a DFlash2 ``selector`` drafter), per-request widths (CPU, neither hybrid nor selector) and
    the cost profile (loadable)."""
    from sglang_ext.controller.cost_model import CostModel

    why = refusals.hybrid_device_refusal(device) if hybrid else None
    if why is not None:
        raise ConfigError(f"model.path: {why}")
    settings = spec.adaptive_settings()
    try:  # the one rule for widths, the same call the worker makes at start-up
        settings.controller.check_against_max_block(draft_block)
    except ValueError as e:
        raise ConfigError(f"speculative.adaptive.{e}") from None
    trees = settings.controller.tree_widths(draft_block)
    why = refusals.deployment_trees_refusal(
        trees, draft_block, device=device, tp_size=number(sglang_args, "tp_size", 1, minimum=1),
        page_size=number(sglang_args, "page_size", 1, minimum=1),
        attention_backend=sglang_args.get("attention_backend"),
        hybrid=hybrid, selector=selector) if trees else None
    if why is not None:
        raise ConfigError(why)
    why = (refusals.deployment_per_request_widths_refusal(device, hybrid=hybrid, selector=selector)
           if settings.controller.per_request_widths else None)
    if why is not None:
        raise ConfigError(f"speculative.adaptive.per_request_widths: {why}")
    if settings.cost_profile is not None:
        path = settings.cost_profile
        if not Path(path).is_file():
            raise ConfigError(f"speculative.adaptive.cost_profile: {path} is not a file")
        try:
            CostModel.from_profile(path, list(settings.controller.candidates_for(draft_block)))
        except (ValueError, KeyError, TypeError, OSError) as e:  # json errors are ValueErrors
            raise ConfigError(f"speculative.adaptive.cost_profile: {path} is not a usable cost profile: {e}") from None


def _preferred_sampling_params(sglang_args: dict) -> dict:
    raw = sglang_args.get("preferred_sampling_params")
    if raw is None or isinstance(raw, dict):
        return raw or {}
    try:
        value = json.loads(raw)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"sglang_args.preferred_sampling_params: not a JSON object ({e}); write it as a JSON "
                          f"string, e.g. '{{\"temperature\": 0.7}}'") from None
    if not isinstance(value, dict):
        raise ConfigError("sglang_args.preferred_sampling_params: must be a JSON object of sampling parameters")
    return value


def _model_sampling_defaults(config: ServeConfig) -> dict:
    """What SGLang takes from the model's generation_config.json under `sampling_defaults: model` (its default;
    configs/model_config.py get_default_sampling_params)."""
    path = config.model.path / "generation_config.json"
    if config.sglang_args.get("sampling_defaults", "model") != "model" or not path.is_file():
        return {}
    try:
        generation = json.loads(path.read_text())
    except ValueError as e:
        raise ConfigError(f"model.path: {path} is not valid JSON: {e}") from None
    keys = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")
    return {k: generation[k] for k in keys if isinstance(generation, dict) and generation.get(k) is not None}


def check_sampling_defaults(config: ServeConfig) -> None:
    """Every request inherits the operator's `preferred_sampling_params` and (chat) the model's generation config:
    one that DFlash cannot serve losslessly (sglang_ext/refusals.py, the rule each request is held to) is
    refused here, with the fix, rather than served lossy or refused on every request."""
    cpu = config.server.device is Device.cpu
    overlap = not config.sglang_args.get("disable_overlap_schedule", cpu and CPU_DEFAULTS["disable_overlap_schedule"])
    sources = (("sglang_args.preferred_sampling_params", _preferred_sampling_params(config.sglang_args),
                "remove it from sglang_args.preferred_sampling_params"),
               ("model.path", _model_sampling_defaults(config),
                "set sglang_args.sampling_defaults: openai to serve without the model's defaults"))
    for field, params, remove in sources:
        why = refusals.sampling_defaults_refusal(params, overlap, from_model=field == "model.path", remove=remove)
        if why is not None:
            raise ConfigError(f"{field}: {why}")

