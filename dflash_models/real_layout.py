"""Tiny drafters whose config.json has the field set of z-lab's published checkpoints, at the bundled pair's sizes.

Why: the bundled drafter's config.json is this repository's own writing (tiny.py `drafter_config`); an operator
serves z-lab's, whose fields differ. Two published layouts (docs/MODELS.md, "Published drafter layouts"):

- **DFlash b16** (`z-lab/Qwen3-8B-DFlash-b16`, `z-lab/Qwen3-4B-DFlash-b16`): `DFlashDraftModel`, the block size at
  the top level, `dflash_config` with `mask_token_id` and `target_layer_ids`, `num_target_layers`, the target's
  Qwen3 fields copied (flat `rope_theta`, `rope_scaling`, `dtype`, `max_window_layers`, ...), full-attention
  layers, `auto_map` naming z-lab's remote class (SGLang serves its own and never runs it).
- **DFlash2** (z-lab's `*-DFlash2` checkpoints): `DFlash2DraftModel`, the block size only inside `dflash_config`
  with the convolution (`conv_kernel_size`, `conv_group_size`) and selector (`selector_rank`, `selector_top_k`)
  fields and the logit scaling (`output_multiplier`, `final_logit_softcapping`), `is_causal: false`, every layer
  `sliding_attention` with a `sliding_window`, the RoPE base nested in `rope_parameters`, `pad_token_id`.

The weights are the given (trained) DFlash drafter's, so acceptance is real; for DFlash2 the convolutions and the
selector are added as in dflash2.py. Values are tiny; the keys are the published ones, no more and no fewer
(`B16_KEYS`, `DFLASH2_KEYS`).

    python -m dflash_models.real_layout b16 models/tiny-code/drafter /tmp/b16
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

B16_KEYS = frozenset({
    "architectures", "attention_bias", "attention_dropout", "auto_map", "block_size", "bos_token_id",
    "dflash_config", "dtype", "eos_token_id", "head_dim", "hidden_act", "hidden_size", "initializer_range",
    "intermediate_size", "layer_types", "max_position_embeddings", "max_window_layers", "model_type",
    "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "num_target_layers", "rms_norm_eps",
    "rope_scaling", "rope_theta", "sliding_window", "tie_word_embeddings", "transformers_version", "use_cache",
    "use_sliding_window", "vocab_size"})
B16_DFLASH_KEYS = frozenset({"mask_token_id", "target_layer_ids"})
DFLASH2_KEYS = frozenset({
    "architectures", "attention_bias", "attention_dropout", "bos_token_id", "is_causal", "dflash_config", "dtype",
    "eos_token_id", "head_dim", "hidden_act", "hidden_size", "initializer_range", "intermediate_size",
    "layer_types", "max_position_embeddings", "max_window_layers", "model_type", "num_attention_heads",
    "num_hidden_layers", "num_key_value_heads", "num_target_layers", "pad_token_id", "rms_norm_eps",
    "rope_parameters", "sliding_window", "tie_word_embeddings", "transformers_version", "use_cache",
    "use_sliding_window", "vocab_size"})
DFLASH2_DFLASH_KEYS = frozenset({
    "block_size", "conv_group_size", "conv_kernel_size", "final_logit_softcapping", "mask_token_id",
    "output_multiplier", "selector_rank", "selector_top_k", "target_layer_ids"})
LAYOUTS = ("b16", "dflash2")


def _rope_theta(cfg: dict) -> float:
    return float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0)


def _common(src: dict) -> dict:
    """The Qwen3 fields both layouts carry, from the source drafter's config.json."""
    n = int(src["num_hidden_layers"])
    dflash = src["dflash_config"]
    return {
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": src.get("bos_token_id"),
        "dtype": src.get("dtype", src.get("torch_dtype", "bfloat16")), "eos_token_id": src.get("eos_token_id"),
        "head_dim": src["head_dim"], "hidden_act": src.get("hidden_act", "silu"), "hidden_size": src["hidden_size"],
        "initializer_range": 0.02, "intermediate_size": src["intermediate_size"],
        "max_position_embeddings": src["max_position_embeddings"], "max_window_layers": n, "model_type": "qwen3",
        "num_attention_heads": src["num_attention_heads"], "num_hidden_layers": n,
        "num_key_value_heads": src["num_key_value_heads"],
        "num_target_layers": src.get("num_target_layers", max(dflash["target_layer_ids"]) + 1),
        "rms_norm_eps": src.get("rms_norm_eps", 1e-6), "transformers_version": "4.57.1",
        "vocab_size": src["vocab_size"],
    }


def b16_config(src: dict, *, tie_word_embeddings: bool) -> dict:
    """The b16 layout of the drafter described by ``src`` (a DFlash drafter's config.json).
    ``tie_word_embeddings``: the target's (z-lab copies it from the target's config; the drafter has no head)."""
    n = int(src["num_hidden_layers"])
    dflash = src["dflash_config"]
    block = src.get("block_size", dflash.get("block_size"))
    cfg = _common(src) | {
        "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "block_size": int(block),
        "dflash_config": {"mask_token_id": dflash["mask_token_id"],
                          "target_layer_ids": list(dflash["target_layer_ids"])},
        "layer_types": ["full_attention"] * n, "rope_scaling": None, "rope_theta": _rope_theta(src),
        "sliding_window": None, "tie_word_embeddings": tie_word_embeddings, "use_cache": True,
        "use_sliding_window": False,
    }
    assert set(cfg) == B16_KEYS and set(cfg["dflash_config"]) == B16_DFLASH_KEYS
    return cfg


def dflash2_config(src: dict, *, sliding_window: int, output_multiplier: float = 0.5,
                   final_logit_softcapping: float = 20.0) -> dict:
    """The DFlash2 layout of ``src`` (a DFlash2 drafter's config.json: dflash2.py's, with its convolution and
    selector fields). The logit scaling differs from 1 / none so the selector's path runs through it."""
    n = int(src["num_hidden_layers"])
    dflash = src["dflash_config"]
    block = src.get("block_size", dflash.get("block_size"))
    cfg = _common(src) | {
        "architectures": [src["architectures"][0]], "is_causal": False,
        "dflash_config": {"block_size": int(block), "conv_group_size": dflash["conv_group_size"],
                          "conv_kernel_size": dflash["conv_kernel_size"],
                          "final_logit_softcapping": final_logit_softcapping,
                          "mask_token_id": dflash["mask_token_id"], "output_multiplier": output_multiplier,
                          "selector_rank": dflash["selector_rank"], "selector_top_k": dflash["selector_top_k"],
                          "target_layer_ids": list(dflash["target_layer_ids"])},
        "layer_types": ["sliding_attention"] * n, "pad_token_id": src.get("eos_token_id"),
        "rope_parameters": {"rope_theta": _rope_theta(src), "rope_type": "default"},
        "sliding_window": sliding_window, "tie_word_embeddings": False, "use_cache": False,
        "use_sliding_window": True,
    }
    assert set(cfg) == DFLASH2_KEYS and set(cfg["dflash_config"]) == DFLASH2_DFLASH_KEYS
    return cfg


def build(layout: str, drafter_dir: str | Path, out_dir: str | Path, *, target_dir: str | Path | None = None,
          sliding_window: int = 2048) -> Path:
    """Write `out_dir`: the DFlash drafter in `drafter_dir` with the published `layout` ("b16" or "dflash2");
    `target_dir` (default: the drafter's sibling `target`) gives b16's tie_word_embeddings. Returns `out_dir`."""
    src_dir, out = Path(drafter_dir), Path(out_dir)
    if layout == "b16":
        target = Path(target_dir) if target_dir else src_dir.parent / "target"
        tied = bool(json.loads((target / "config.json").read_text()).get("tie_word_embeddings", False))
        out.mkdir(parents=True, exist_ok=True)
        for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
            if (src_dir / name).is_file():
                shutil.copyfile(src_dir / name, out / name)
        cfg = b16_config(json.loads((src_dir / "config.json").read_text()), tie_word_embeddings=tied)
    elif layout == "dflash2":
        from dflash_models import dflash2

        # the published convolution has two taps; conv_group_size 16 as published
        dflash2.convert(src_dir, out, conv_kernel_size=2, conv_group_size=16)
        cfg = dflash2_config(json.loads((out / "config.json").read_text()), sliding_window=sliding_window)
    else:
        raise ValueError(f"layout {layout!r}: one of {', '.join(LAYOUTS)}")
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("layout", choices=LAYOUTS)
    p.add_argument("drafter_dir", help="a DFlash drafter (e.g. models/tiny-code/drafter)")
    p.add_argument("out_dir")
    p.add_argument("--sliding-window", type=int, default=2048, help="dflash2: the layers' window")
    a = p.parse_args(argv)
    print(f"[real_layout] {build(a.layout, a.drafter_dir, a.out_dir, sliding_window=a.sliding_window)}")


if __name__ == "__main__":
    main()
