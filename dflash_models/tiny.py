"""Deterministic tiny test pair: a random Qwen3 target and a z-lab-format DFlash drafter.

Built in seconds for tests and for the embedded default until a trained pair exists.
A random drafter accepts nothing against a random target, so the target is *biased*:
its LM head maps one coordinate of the final hidden state to a fixed token V*, and the
mask token's embedding points along that coordinate. The drafter's block inputs are mask
embeddings, so it proposes V* everywhere, and the target emits V* often but not always
(depending on context) -> partial acceptance, which exercises every verify path.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_models import corpus
from dflash_models.tokenizer import special_ids, train_tokenizer


@dataclass(frozen=True)
class TinySpec:
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 4096
    draft_layers: int = 2
    block_size: int = 16
    target_layer_ids: tuple[int, ...] = (1, 2)
    bias_token: int = 1000  # V*
    bias_dim: int = 7  # the hidden coordinate that selects V*
    bias_head: float = 10.0  # LM-head weight: higher -> target emits V* more often (~30% at 10)
    init_std: float = 0.1  # large enough that greedy output is diverse, not one repeated token
    bias_mask: float = 10.0  # mask embedding along bias_dim
    tokenizer_files: int = 200
    seed: int = 0


def qwen3_config(spec: Any, ids: dict[str, int], *, tie_word_embeddings: bool, initializer_range: float,
                 torch_dtype: str | None = None):
    """The Qwen3 config of the bundled pair's targets, the random one here and the trained one
    (train_target.py): ``spec`` has the shape fields (TinySpec, train_target.TargetSpec); ``ids`` the tokenizer's
    special tokens."""
    from transformers import Qwen3Config

    extra = {} if torch_dtype is None else {"torch_dtype": torch_dtype}
    return Qwen3Config(
        hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim, vocab_size=spec.vocab_size,
        max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
        rope_theta=10000.0, rms_norm_eps=1e-6, initializer_range=initializer_range,
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
        **extra,
    )


def drafter_config(target_cfg: dict, *, num_layers: int, block_size: int, target_layer_ids: list[int],
                   mask_token_id: int, intermediate_size: int | None = None) -> dict:
    """z-lab DFlash config.json for a drafter of `target_cfg` (shares its vocab and hidden size)."""
    h = target_cfg["hidden_size"]
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
        "num_target_layers": target_cfg["num_hidden_layers"],
        "hidden_size": h,
        "intermediate_size": intermediate_size or target_cfg["intermediate_size"],
        "num_hidden_layers": num_layers,
        "num_attention_heads": target_cfg["num_attention_heads"],
        "num_key_value_heads": target_cfg["num_key_value_heads"],
        "head_dim": target_cfg["head_dim"],
        "vocab_size": target_cfg["vocab_size"],
        "max_position_embeddings": target_cfg["max_position_embeddings"],
        "rms_norm_eps": target_cfg.get("rms_norm_eps", 1e-6),
        "rope_theta": target_cfg.get("rope_theta", (target_cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "layer_types": ["full_attention"] * num_layers,
        "use_sliding_window": False,
        "sliding_window": None,
        "bos_token_id": target_cfg.get("bos_token_id"),
        "eos_token_id": target_cfg.get("eos_token_id"),
    }


def random_drafter_weights(cfg: dict, seed: int, std: float = 0.02) -> dict:
    """Random weights with z-lab's tensor names (no embedding / LM head: the target's are shared)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    k = len(cfg["dflash_config"]["target_layer_ids"])

    def w(*shape):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    sd = {"norm.weight": ones(h), "fc.weight": w(h, k * h), "hidden_norm.weight": ones(h)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"layers.{layer}."
        sd |= {
            p + "self_attn.q_proj.weight": w(nh * hd, h), p + "self_attn.k_proj.weight": w(nkv * hd, h),
            p + "self_attn.v_proj.weight": w(nkv * hd, h), p + "self_attn.o_proj.weight": w(h, nh * hd),
            p + "self_attn.q_norm.weight": ones(hd), p + "self_attn.k_norm.weight": ones(hd),
            p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
            p + "mlp.down_proj.weight": w(h, i),
            p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
        }
    return sd


def save_drafter(out: Path, cfg: dict, state_dict: dict, tokenizer_dir: Path | None = None) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    if tokenizer_dir is not None:  # some loaders look for a tokenizer beside the drafter
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (out / name).write_bytes((tokenizer_dir / name).read_bytes())


def build(out_dir: str | Path, spec: TinySpec = TinySpec(), log=print) -> dict[str, Path]:
    """Create `out_dir/target` and `out_dir/drafter`. Returns their paths."""
    import torch
    from transformers import Qwen3ForCausalLM

    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    target_dir, draft_dir = out_dir / "target", out_dir / "drafter"
    files = corpus.stdlib_files()[: spec.tokenizer_files]
    log(f"[tiny] training tokenizer on {len(files)} stdlib files (vocab {spec.vocab_size})")
    tok = train_tokenizer((corpus.read_text(f) for f in files), spec.vocab_size, target_dir)
    ids = special_ids(tok)
    if len(tok) != spec.vocab_size:
        raise RuntimeError(f"tokenizer has {len(tok)} tokens, expected {spec.vocab_size}")

    log("[tiny] building random Qwen3 target (biased LM head)")
    torch.manual_seed(spec.seed)
    model = Qwen3ForCausalLM(qwen3_config(spec, ids, tie_word_embeddings=False, initializer_range=spec.init_std,
                                          torch_dtype="bfloat16"))
    with torch.no_grad():
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.copy_(emb)  # untied copy, then bias one row
        head[spec.bias_token].zero_()
        head[spec.bias_token, spec.bias_dim] = spec.bias_head
        emb[ids["<|mask|>"]].zero_()
        emb[ids["<|mask|>"], spec.bias_dim] = spec.bias_mask
    model.to(torch.bfloat16).save_pretrained(target_dir)
    model.generation_config.save_pretrained(target_dir)

    log("[tiny] building random DFlash drafter")
    tcfg = json.loads((target_dir / "config.json").read_text())
    dcfg = drafter_config(tcfg, num_layers=spec.draft_layers, block_size=spec.block_size,
                          target_layer_ids=list(spec.target_layer_ids), mask_token_id=ids["<|mask|>"])
    save_drafter(draft_dir, dcfg, random_drafter_weights(dcfg, spec.seed + 1), tokenizer_dir=target_dir)
    log(f"[tiny] done in {time.perf_counter() - t0:.1f}s -> {out_dir}")
    return {"target": target_dir, "drafter": draft_dir}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", help="directory to create (target/ and drafter/ inside)")
    p.add_argument("--block-size", type=int, default=TinySpec.block_size)
    p.add_argument("--bias-head", type=float, default=TinySpec.bias_head,
                   help="strength of the target's bias towards the drafter's token (0 = no acceptance)")
    a = p.parse_args(argv)
    build(a.out_dir, TinySpec(block_size=a.block_size, bias_head=a.bias_head))


if __name__ == "__main__":
    main()
