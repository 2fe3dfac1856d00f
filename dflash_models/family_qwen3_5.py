"""A tiny random Qwen3.5 text target (gated delta net + full attention layers) and a DFlash drafter for it.

Built from transformers' own `Qwen3_5TextConfig` (so SGLang loads it through `Qwen3_5ForCausalLM`, the class a real
Qwen3.5 checkpoint's text stack takes), with the bundled tokenizer (models/tiny-code), in seconds at test time.
As in `tiny.py`, the target is biased so a random drafter is partly accepted: its LM head maps one hidden coordinate
to a fixed token, and the mask token's embedding points along it.
"""
from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from dflash_models.tiny import drafter_config, random_drafter_weights, save_drafter

BUNDLED_TOKENIZER = Path(__file__).resolve().parents[1] / "models" / "tiny-code" / "target"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
ARCHITECTURE = "Qwen3_5ForCausalLM"


@dataclass(frozen=True)
class Qwen35Spec:
    vocab_size: int = 4096
    hidden_size: int = 64
    intermediate_size: int = 128
    # Qwen3.5's own ratio, three gated-delta-net layers to one full-attention layer
    layer_types: tuple[str, ...] = ("linear_attention", "linear_attention", "linear_attention", "full_attention")
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    linear_key_heads: int = 2
    linear_value_heads: int = 4
    linear_head_dim: int = 16
    conv_kernel: int = 4
    init_std: float = 0.1  # large enough that greedy output is diverse, not one repeated token
    bias_token: int = 1000  # tiny.py's V*
    bias_dim: int = 7
    bias_head: float = 10.0
    bias_mask: float = 10.0
    draft_layers: int = 1
    block_size: int = 8
    target_layer_ids: tuple[int, ...] = (1, 2)  # gated-delta-net layers (SGLang captures below the last layer)
    seed: int = 0


def _ids(tokenizer_dir: Path) -> dict[str, int]:
    from transformers import AutoTokenizer

    from dflash_models.tokenizer import special_ids

    return special_ids(AutoTokenizer.from_pretrained(str(tokenizer_dir)))


def config(spec: Qwen35Spec, ids: dict[str, int]):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=len(spec.layer_types), layer_types=list(spec.layer_types),
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        linear_num_key_heads=spec.linear_key_heads, linear_num_value_heads=spec.linear_value_heads,
        linear_key_head_dim=spec.linear_head_dim, linear_value_head_dim=spec.linear_head_dim,
        linear_conv_kernel_dim=spec.conv_kernel, max_position_embeddings=4096, tie_word_embeddings=False,
        rms_norm_eps=1e-6, initializer_range=spec.init_std, torch_dtype="bfloat16",
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
        # what real Qwen3.5 checkpoints also carry: SGLang derives the layer kinds from it, not from layer_types
        full_attention_interval=_interval(spec.layer_types),
    )


def _interval(layer_types: tuple[str, ...]) -> int:
    n = layer_types.index("full_attention") + 1
    expected = tuple("full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(len(layer_types)))
    if expected != tuple(layer_types):
        raise ValueError(f"layer_types {layer_types} is not every {n}th layer full attention, the only pattern "
                         f"SGLang reads (full_attention_interval)")
    return n


def build_qwen3_5_target(path: str | Path, spec: Qwen35Spec = Qwen35Spec(),
                         tokenizer_dir: Path = BUNDLED_TOKENIZER) -> Path:
    """Write a random tiny Qwen3.5 text target (HF format, the bundled tokenizer) to `path`; returns it."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copyfile(tokenizer_dir / name, path / name)
    ids = _ids(path)
    torch.manual_seed(spec.seed)
    model = Qwen3_5ForCausalLM(config(spec, ids))
    with torch.no_grad():
        emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        head[spec.bias_token].zero_()
        head[spec.bias_token, spec.bias_dim] = spec.bias_head
        emb[ids["<|mask|>"]].zero_()
        emb[ids["<|mask|>"], spec.bias_dim] = spec.bias_mask
    model.to(torch.bfloat16).save_pretrained(path)
    model.generation_config.save_pretrained(path)
    return path


def build_dflash_drafter_for(target_path: str | Path, out_path: str | Path, spec: Qwen35Spec = Qwen35Spec()) -> Path:
    """Write a random z-lab-format DFlash drafter for the target at `target_path` to `out_path`; returns it."""
    target_path, out_path = Path(target_path), Path(out_path)
    tcfg = json.loads((target_path / "config.json").read_text())
    tcfg.setdefault("rope_theta", (tcfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    dcfg = drafter_config(tcfg, num_layers=spec.draft_layers, block_size=spec.block_size,
                          target_layer_ids=list(spec.target_layer_ids), mask_token_id=_ids(target_path)["<|mask|>"])
    save_drafter(out_path, dcfg, random_drafter_weights(dcfg, spec.seed + 1), tokenizer_dir=target_path)
    return out_path


def build(out_dir: str | Path, spec: Qwen35Spec = Qwen35Spec()) -> dict[str, Path]:
    """`out_dir/target` and `out_dir/drafter`."""
    out_dir = Path(out_dir)
    target = build_qwen3_5_target(out_dir / "target", spec)
    return {"target": target, "drafter": build_dflash_drafter_for(target, out_dir / "drafter", spec)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", help="directory to create (target/ and drafter/ inside)")
    print(build(p.parse_args(argv).out_dir))


if __name__ == "__main__":
    main()
