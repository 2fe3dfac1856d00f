"""The GPU check's large pair, built on the GPU machine: a Qwen3-8B-shaped target and a z-lab-b16-shaped DFlash drafter.

The target is only a config (SGLang fills random weights: `load_format: dummy`, a forward's time does not depend on
their values) beside the bundled pair's tokenizer files, which the preflight looks for and the server never loads
(`skip_tokenizer_init`). The drafter gets real random bf16 weights with z-lab's tensor names, so the draft goes
through the real weight loader (dflash_models/tiny.py builds both halves the same way for the tiny pairs).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from dflash_models.tiny import drafter_config, random_drafter_weights, save_drafter

REPO = Path(__file__).resolve().parents[2]
TOKENIZER_FROM = REPO / "models/tiny-code/target"

# Qwen3-8B's published config.json, less what does not shape the forward
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 151643, "eos_token_id": 151645, "use_sliding_window": False, "sliding_window": None,
}
# z-lab/Qwen3-8B-DFlash-b16's shape: 5 layers over 5 target layers, block 16
DRAFT_LAYERS = 5
DRAFT_BLOCK = 16
DRAFT_TARGET_LAYERS = [1, 9, 17, 25, 33]
MASK_TOKEN_ID = 151669


def build(out: Path, *, drafter_weights: bool = True) -> dict[str, Path]:
    """Write `out/target` and `out/drafter` (idempotent: an existing pair is kept); returns their paths."""
    target, drafter = out / "target", out / "drafter"
    if (drafter / "model.safetensors").is_file() and (target / "config.json").is_file():
        return {"target": target, "drafter": drafter}
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(QWEN3_8B, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_FROM / name, target / name)
    cfg = drafter_config(QWEN3_8B, num_layers=DRAFT_LAYERS, block_size=DRAFT_BLOCK,
                         target_layer_ids=DRAFT_TARGET_LAYERS, mask_token_id=MASK_TOKEN_ID)
    weights = random_drafter_weights(cfg, seed=0) if drafter_weights else {}
    save_drafter(drafter, cfg, weights, tokenizer_dir=target)
    return {"target": target, "drafter": drafter}
