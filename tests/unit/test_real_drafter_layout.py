"""z-lab's published drafter layouts (config.json of Qwen3-8B-DFlash-b16 and of a DFlash2 drafter) pass
`dflash-serve check` and the preflight, at tiny sizes with exactly the published fields (dflash_models/real_layout.py);
configs SGLang's DFlash loader cannot build are refused with the field named. Serving them:
tests/integration/test_real_drafter_layout.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dflash_models import real_layout
from service import cli
from service.config import ConfigError, load_config
from service.memory_plan import Shape
from service.preflight import check
from sglang_ext import refusals
from tests.conftest import default_config


@pytest.fixture(scope="module")
def drafters(tiny_pair, tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("real-layout")
    return {layout: real_layout.build(layout, tiny_pair["drafter"], out / layout, target_dir=tiny_pair["target"])
            for layout in real_layout.LAYOUTS}


def config_file(tmp_path: Path, pair, drafter: Path, algorithm: str) -> Path:
    p = tmp_path / f"{algorithm}.yaml"
    p.write_text(yaml.safe_dump(default_config(pair, algorithm=algorithm, draft_model_path=drafter)))
    return p


def test_the_tiny_drafters_carry_exactly_the_published_fields(drafters):
    b16 = json.loads((drafters["b16"] / "config.json").read_text())
    assert set(b16) == real_layout.B16_KEYS and set(b16["dflash_config"]) == real_layout.B16_DFLASH_KEYS
    assert b16["architectures"] == ["DFlashDraftModel"] and isinstance(b16["block_size"], int)
    d2 = json.loads((drafters["dflash2"] / "config.json").read_text())
    assert set(d2) == real_layout.DFLASH2_KEYS and set(d2["dflash_config"]) == real_layout.DFLASH2_DFLASH_KEYS
    assert "block_size" not in d2 and d2["dflash_config"]["block_size"] == 16  # only where DFlash2 sets it
    assert set(d2["layer_types"]) == {"sliding_attention"} and d2["is_causal"] is False
    assert "rope_theta" not in d2 and d2["rope_parameters"]["rope_theta"] > 0


@pytest.mark.parametrize("algorithm", ["dflash", "dflash_adaptive"])
@pytest.mark.parametrize("layout", real_layout.LAYOUTS)
def test_dflash_serve_check_accepts_the_published_layout(drafters, tiny_pair, tmp_path, capsys, layout, algorithm):
    path = config_file(tmp_path, tiny_pair, drafters[layout], algorithm)
    assert cli.main(["check", "--config", str(path), "--skip-sglang-args"]) == 0
    assert f"{algorithm} drafter {drafters[layout]} (trained block 16" in capsys.readouterr().out
    report = check(load_config(path))
    assert report.draft_block_size == 16 and report.target_layer_ids == (1, 3)


def test_block_size_is_read_where_sglang_reads_it_first(drafters, tiny_pair, tmp_path):
    """dflash_config.block_size wins over a top-level one (SGLang's parse_dflash_draft_config), so the preflight
    checks the block the server will run."""
    d = tmp_path / "both"
    real_layout.build("dflash2", tiny_pair["drafter"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["dflash_config"]["block_size"], cfg["block_size"] = 8, 16
    (d / "config.json").write_text(json.dumps(cfg))
    assert check(load_config(config_file(tmp_path, tiny_pair, d, "dflash"))).draft_block_size == 8


@pytest.mark.parametrize("change, named", [
    (lambda c: c.update(layer_types=["sliding_attention"]), "one attention type per draft layer"),
    (lambda c: c.update(layer_types=["linear_attention"] * 2), "full_attention or sliding_attention"),
    (lambda c: c.update(sliding_window=None), "no sliding_window"),
    (lambda c: c["dflash_config"].pop("conv_group_size"), "conv_kernel_size"),
    (lambda c: c["dflash_config"].update(conv_group_size=24), "does not divide hidden_size 256"),
    (lambda c: c["dflash_config"].pop("selector_top_k"), "selector_rank"),
])
def test_a_layout_sglangs_loader_cannot_build_is_refused_naming_the_field(drafters, tiny_pair, tmp_path, change,
                                                                        named):
    d = tmp_path / "bad"
    real_layout.build("dflash2", tiny_pair["drafter"], d)
    cfg = json.loads((d / "config.json").read_text())
    change(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=named):
        check(load_config(config_file(tmp_path, tiny_pair, d, "dflash_adaptive")))


def test_the_published_layouts_pass_the_layout_rule_at_their_real_sizes():
    """The rule on the published values themselves (not only the tiny ones): Qwen3-8B-DFlash-b16's sizes and a
    DFlash2 drafter's (hidden 6656, conv groups of 16, selector rank 256 / top-k 16, window 2048)."""
    src = {"num_hidden_layers": 5, "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
           "num_target_layers": 36, "rope_theta": 1000000, "block_size": 16, "bos_token_id": 151643,
           "eos_token_id": 151645,
           "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}}
    b16 = real_layout.b16_config(src, tie_word_embeddings=False)
    assert refusals.drafter_layout_refusal(b16) is None
    d2 = real_layout.dflash2_config(
        src | {"architectures": ["DFlash2DraftModel"], "hidden_size": 6656,
               "dflash_config": src["dflash_config"] | {"conv_kernel_size": 2, "conv_group_size": 16,
                                                        "selector_rank": 256, "selector_top_k": 16}},
        sliding_window=2048)
    assert refusals.drafter_layout_refusal(d2) is None


def test_the_memory_plan_counts_a_dflash2_drafters_sliding_layers_as_kv_layers(drafters):
    """SGLang builds no sliding-window pool for DFlash draft architectures: every draft layer keeps its KV."""
    d2 = json.loads((drafters["dflash2"] / "config.json").read_text())
    assert Shape.of(d2).kv_layers == d2["num_hidden_layers"]
    gemma_like = {"num_hidden_layers": 3, "num_attention_heads": 2, "hidden_size": 64, "intermediate_size": 128,
                  "vocab_size": 4096, "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]}
    assert Shape.of(gemma_like).kv_layers == 1  # a target's sliding layers: SGLang's sliding-window pool
