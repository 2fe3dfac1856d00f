"""Preflight: is the target servable, and does the drafter fit it? Fails fast, naming the field.

Runs before SGLang starts (which takes 30 s+ and then fails with a deep traceback, or --
for some mismatches -- silently: DFlash's weight loader ignores unknown tensor names).
Reads only config.json files and the safetensors header; imports neither torch nor sglang.
"""
from __future__ import annotations

import json
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

from service.config import ConfigError, ServeConfig
from sglang_ext import names

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
    refusal = _gpu_kit_refusal(config.server.device.value)
    if refusal is not None:
        raise ConfigError(refusal)
    target = _read_config(config.model.path, "model.path")
    tok_dir = config.model.tokenizer or config.model.path
    if not any((tok_dir / f).is_file() for f in _TOKENIZER_FILES):
        field = "model.tokenizer" if config.model.tokenizer else "model.path"
        raise ConfigError(f"{field}: no tokenizer files in {tok_dir} (set model.tokenizer to a tokenizer directory)")
    n_layers = _get_int(target, "num_hidden_layers", "model.path", config.model.path)
    hidden = _get_int(target, "hidden_size", "model.path", config.model.path)
    vocab = _get_int(target, "vocab_size", "model.path", config.model.path)
    spec = config.speculative
    if spec.algorithm == "none":
        return PreflightReport(n_layers, hidden, vocab, None, None)

    for key in ("enable_watermark", "enable-watermark"):
        if config.sglang_args.get(key):
            raise ConfigError(f"sglang_args.{key}: DFlash's verify does not apply SGLang's watermark, so outputs would "
                              f"silently carry none; serve watermarked traffic with speculative.algorithm: none")
    where = spec.draft_model_path
    field = "speculative.draft_model_path"
    draft = _read_config(where, field)
    if not list(where.glob("*.safetensors")):
        raise ConfigError(f"{field}: no *.safetensors weights in {where}")
    d_hidden = _get_int(draft, "hidden_size", field, where)
    if d_hidden != hidden:
        raise ConfigError(f"{field}: drafter hidden_size {d_hidden} does not match the target's {hidden} "
                          f"(model.path); this drafter was trained for another model")
    d_vocab = _get_int(draft, "vocab_size", field, where)
    if d_vocab != vocab:
        raise ConfigError(f"{field}: drafter vocab_size {d_vocab} does not match the target's {vocab} "
                          f"(model.path); drafter and target must share a tokenizer")
    dflash = draft.get("dflash_config") or {}
    layer_ids = dflash.get("target_layer_ids")
    if not isinstance(layer_ids, list) or not layer_ids or not all(isinstance(i, int) for i in layer_ids):
        raise ConfigError(f"{field}: config.json needs dflash_config.target_layer_ids (a list of target layer indices)")
    bad = [i for i in layer_ids if not 0 <= i < n_layers]
    if bad:
        raise ConfigError(f"{field}: dflash_config.target_layer_ids {bad} out of range for a target with "
                          f"{n_layers} layers (valid: 0..{n_layers - 1})")
    mask = dflash.get("mask_token_id")
    if mask is not None and not (isinstance(mask, int) and 0 <= mask < vocab):
        raise ConfigError(f"{field}: dflash_config.mask_token_id {mask} is outside the target vocabulary (0..{vocab - 1})")
    draft_block = draft.get("block_size", dflash.get("block_size"))
    if not isinstance(draft_block, int) or draft_block < 2:
        raise ConfigError(f"{field}: config.json needs an integer block_size >= 2 (the drafter's trained block)")
    block = spec.block_size or draft_block
    if block > draft_block:
        raise ConfigError(f"speculative.block_size: {block} is larger than the drafter's trained block_size "
                          f"{draft_block}; use a value in 2..{draft_block}")
    if spec.algorithm == "dflash_adaptive":
        _check_adaptive(spec, draft_block, config.server.device.value, config.sglang_args)
    fc = _safetensors_shapes(where).get("fc.weight")
    if fc is not None and fc != [hidden, len(layer_ids) * hidden]:
        raise ConfigError(f"{field}: fc.weight has shape {fc}, expected [{hidden}, {len(layer_ids) * hidden}] "
                          f"for {len(layer_ids)} target layers of hidden size {hidden}")
    return PreflightReport(n_layers, hidden, vocab, draft_block, block, tuple(layer_ids))


def _gpu_kit_refusal(device: str) -> str | None:
    """The GPU kit's test-only mode is served only where the kit's start-up hook ran in this process (it stands
    in for sgl_kernel, which the hook finds absent): the variable alone must never change how a server runs."""
    if os.environ.get(names.GPU_KIT_TEST_ONLY) is None:
        return None
    from sglang_ext.cpu.stubs import is_stub

    if device == "cuda" and is_stub(sys.modules.get("sgl_kernel")):
        return None
    return (f"{names.GPU_KIT_TEST_ONLY} is set, but it is a test-only mode that only scripts/gpu-kit/run.sh runs "
            f"(on a lent GPU without sgl-kernel); unset it to serve")


# GPU attention backends whose verify reads a tree's mask (sglang_ext/verify_runtimes.py TREE_MASK_BACKENDS, by
# their sglang_args.attention_backend names); unset: the worker checks the backend SGLang picked, at start-up
TREE_ATTENTION_BACKENDS = ("flashinfer", "triton")


def _tree_refusal(device: str, sglang_args: dict) -> str | None:
    tp_size = int(sglang_args.get("tp_size") or 1)
    if tp_size != 1:
        return f"needs tensor parallel size 1, not {tp_size}"
    if device == "cpu":
        return None
    if os.environ.get(names.GPU_TREES) != "1":
        return f"has not served on a GPU yet (set {names.GPU_TREES}=1 to run it on device {device})"
    backend = sglang_args.get("attention_backend")
    if backend is not None and backend not in TREE_ATTENTION_BACKENDS:
        return (f"on GPU needs an attention backend that reads the tree's mask ({' or '.join(TREE_ATTENTION_BACKENDS)}"
                f"), not sglang_args.attention_backend {backend}")
    page = int(sglang_args.get("page_size") or 1)
    if page != 1:
        return f"needs KV page size 1, not sglang_args.page_size {page}"
    return None


def _check_adaptive(spec, draft_block: int, device: str, sglang_args: dict) -> None:
    """The controller settings against the drafter (widths <= 4x its block; trees above it without tensor
    parallelism, and on GPU with an attention backend that reads the tree's mask and page size 1), per-request
    widths (CPU) and the cost profile (loadable)."""
    from sglang_ext.controller.cost_model import CostModel

    settings = spec.adaptive_settings()
    try:  # the one rule for widths, the same call the worker makes at start-up
        settings.controller.check_against_max_block(draft_block)
    except ValueError as e:
        raise ConfigError(f"speculative.adaptive.{e}") from None
    trees = settings.controller.tree_widths(draft_block)
    why = _tree_refusal(device, sglang_args) if trees else None
    if why is not None:
        raise ConfigError(f"speculative.adaptive.candidates: widths {list(trees)} are above the drafter's block "
                          f"{draft_block}, so they verify a DDTree, which {why}; use widths up to {draft_block}")
    if settings.controller.per_request_widths and device != "cpu":
        raise ConfigError(f"speculative.adaptive.per_request_widths: runs on CPU only in this release (the ragged "
                          f"verify reads the CPU attention's layout; GPU verify graphs are per width), not device "
                          f"{device}; set it false")
    if settings.cost_profile is not None:
        path = settings.cost_profile
        if not Path(path).is_file():
            raise ConfigError(f"speculative.adaptive.cost_profile: {path} is not a file")
        try:
            CostModel.from_profile(path, list(settings.controller.candidates_for(draft_block)))
        except (ValueError, KeyError, TypeError, OSError) as e:  # json errors are ValueErrors
            raise ConfigError(f"speculative.adaptive.cost_profile: {path} is not a usable cost profile: {e}") from None
