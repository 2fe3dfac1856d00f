"""Tiny random-weight targets of real architectures, each with a matching random DFlash drafter.

One row per target family of the support matrix (docs/MODELS.md): the target is built from transformers' own
config class (so SGLang loads it through the very model class a real checkpoint of that family takes), with the
bundled tokenizer (models/tiny-code), 3 layers and hidden 64, saved in seconds at test time. The drafter is a
z-lab-format DFlash drafter whose hidden size and `target_layer_ids` fit the target.

As in `tiny.py`, the target is biased so a random drafter is partly accepted: its LM head maps one hidden
coordinate to a fixed token, and the mask token's embedding points along it.

Other modules add rows with `register`: a family's `make_target` returns the target's model (bias, save and the
plain drafter are shared); `make_drafter` replaces the plain drafter (e.g. a DFlash2 drafter for the same target).
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from dflash_models.tiny import drafter_config, random_drafter_weights, save_drafter

BUNDLED_TOKENIZER = Path(__file__).resolve().parents[1] / "models" / "tiny-code" / "target"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
VOCAB = 4096
HIDDEN = 64
LAYERS = 3  # target_layer_ids [0, 1]: SGLang captures layer k's output before layer k + 1, so not the last
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
SLIDING_WINDOW = 8  # shorter than every test prompt: the sliding layers really drop context
BIAS_TOKEN, BIAS_DIM, BIAS_HEAD, BIAS_MASK = 1000, 7, 10.0, 10.0


@dataclass(frozen=True)
class Family:
    """A target family: `make_target(ids)` returns a random transformers model of that architecture."""
    name: str
    architecture: str  # config.json `architectures[0]`, what the preflight reads
    make_target: Callable[[dict[str, int]], object]
    notes: str = ""
    drafter_overrides: dict = field(default_factory=dict)  # merged into the plain drafter's config.json
    # writes the drafter instead of the plain DFlash one: (drafter config, out dir, target dir, seed) -> None
    make_drafter: Callable[[dict, Path, Path, int], None] | None = None
    dtype: str = "bfloat16"  # the checkpoint's dtype
    # builds the whole pair instead of `build`'s generic recipe: (out dir) -> {"target": dir, "drafter": dir}
    build_pair: Callable[[Path], dict[str, Path]] | None = None


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    if family.name in FAMILIES:
        raise ValueError(f"family {family.name!r} is already registered")
    FAMILIES[family.name] = family
    return family


def _common(ids: dict[str, int]) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=4096,
                tie_word_embeddings=False, rms_norm_eps=1e-6, initializer_range=0.1,
                bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])


def _qwen3(ids):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(intermediate_size=128, **_common(ids)))


def _llama3(ids):
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 512}
    return LlamaForCausalLM(LlamaConfig(intermediate_size=128, rope_parameters=rope, **_common(ids)))


def _qwen3_moe(ids):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                                              num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                                              mlp_only_layers=[], **_common(ids)))


def _gemma4(ids):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    cfg = Gemma4TextConfig(intermediate_size=128, sliding_window=SLIDING_WINDOW,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                           hidden_size_per_layer_input=0, vocab_size_per_layer_input=VOCAB, per_layer_config={},
                           **_common(ids))
    return Gemma4ForCausalLM(cfg)


def _gpt_oss(ids):
    from transformers import GptOssConfig, GptOssForCausalLM

    return GptOssForCausalLM(GptOssConfig(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                                          layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                          sliding_window=SLIDING_WINDOW, **_common(ids)))


register(Family("qwen3", "Qwen3ForCausalLM", _qwen3, notes="dense (what tiny.py builds, smaller)"))
register(Family("llama3", "LlamaForCausalLM", _llama3, notes="dense, llama3 RoPE scaling"))
register(Family("qwen3_moe", "Qwen3MoeForCausalLM", _qwen3_moe, notes="MoE: 8 experts, top-2"))
register(Family("gemma4", "Gemma4ForCausalLM", _gemma4, notes="sliding + global attention"))
# fp32: SGLang builds gpt-oss's attention projections in the checkpoint's dtype, so the fp32 CPU server needs an
# fp32 checkpoint (the preflight refuses a bf16 one under model.dtype float32: sglang_ext/support.py)
register(Family("gpt_oss", "GptOssForCausalLM", _gpt_oss, notes="MoE, sliding window, attention sinks",
                dtype="float32"))


def _qwen3_5(ids: dict[str, int]):
    from transformers import Qwen3_5ForCausalLM

    from dflash_models import family_qwen3_5

    return Qwen3_5ForCausalLM(family_qwen3_5.config(family_qwen3_5.Qwen35Spec(), ids))


def _qwen3_5_pair(out_dir: Path) -> dict[str, Path]:
    from dflash_models import family_qwen3_5

    return family_qwen3_5.build(out_dir)


# hybrid: its own builder (SGLang reads `full_attention_interval`, not `layer_types`; its drafter's feature layers)
register(Family("qwen3_5", "Qwen3_5ForCausalLM", _qwen3_5, notes="hybrid: gated delta net + full attention",
                build_pair=_qwen3_5_pair))


def _bias(model, ids: dict[str, int]) -> None:
    """A fixed LM-head row for BIAS_TOKEN along BIAS_DIM, and the mask embedding along it (module docstring)."""
    import torch

    with torch.no_grad():
        emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
        head[BIAS_TOKEN].zero_()
        head[BIAS_TOKEN, BIAS_DIM] = BIAS_HEAD
        emb[ids["<|mask|>"]].zero_()
        emb[ids["<|mask|>"], BIAS_DIM] = BIAS_MASK


def build(name: str, out_dir: str | Path, *, block_size: int = 8, seed: int = 0,
          tokenizer_dir: Path = BUNDLED_TOKENIZER) -> dict[str, Path]:
    """Create `out_dir/target` and `out_dir/drafter` for family `name`. Returns their paths."""
    import torch
    from transformers import AutoTokenizer

    from dflash_models.tokenizer import special_ids

    if name not in FAMILIES:
        raise KeyError(f"unknown family {name!r}; registered: {sorted(FAMILIES)}")
    family = FAMILIES[name]
    out_dir = Path(out_dir)
    if family.build_pair is not None:
        return family.build_pair(out_dir)
    target_dir, draft_dir = out_dir / "target", out_dir / "drafter"
    target_dir.mkdir(parents=True, exist_ok=True)
    for f in TOKENIZER_FILES:
        if (tokenizer_dir / f).is_file():
            shutil.copyfile(tokenizer_dir / f, target_dir / f)
    ids = special_ids(AutoTokenizer.from_pretrained(str(target_dir)))
    torch.manual_seed(seed)
    model = family.make_target(ids)
    _bias(model, ids)
    model.to(getattr(torch, family.dtype)).save_pretrained(target_dir)
    model.generation_config.save_pretrained(target_dir)

    tcfg = json.loads((target_dir / "config.json").read_text())
    tcfg = tcfg.get("text_config", tcfg)
    shape = {"num_hidden_layers": LAYERS, "hidden_size": HIDDEN, "intermediate_size": 128,
             "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
             "vocab_size": VOCAB, "max_position_embeddings": 4096}
    dcfg = drafter_config(tcfg | shape, num_layers=2, block_size=block_size, target_layer_ids=[0, 1],
                          mask_token_id=ids["<|mask|>"])
    dcfg |= family.drafter_overrides
    if family.make_drafter is not None:
        family.make_drafter(dcfg, draft_dir, target_dir, seed + 1)
    else:
        save_drafter(draft_dir, dcfg, random_drafter_weights(dcfg, seed + 1), tokenizer_dir=target_dir)
    return {"target": target_dir, "drafter": draft_dir}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("family", choices=sorted(FAMILIES))
    p.add_argument("out_dir", help="directory to create (target/ and drafter/ inside)")
    p.add_argument("--block-size", type=int, default=8)
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    paths = build(a.family, a.out_dir, block_size=a.block_size)
    print(f"[families] {a.family} in {time.perf_counter() - t0:.1f}s -> {paths}")


if __name__ == "__main__":
    main()
