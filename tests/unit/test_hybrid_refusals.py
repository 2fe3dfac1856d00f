"""A hybrid target (gated-delta-net layers) under dflash_adaptive: chain widths pass the preflight; tree widths and
per-request widths are refused with the reason and the fix (sglang_ext/refusals.py, the worker's rule too)."""
from __future__ import annotations

import pytest
import yaml

from service.config import ConfigError, load_config
from service.preflight import check
from sglang_ext import refusals


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory):
    from dflash_models import family_qwen3_5

    return family_qwen3_5.build(tmp_path_factory.mktemp("qwen3_5"))


def _check(tmp_path, pair, **adaptive):
    data = {"model": {"path": str(pair["target"])},
            "speculative": {"algorithm": "dflash_adaptive", "draft_model_path": str(pair["drafter"]),
                            "adaptive": adaptive}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(data))
    return check(load_config(tmp_path / "cfg.yaml"))


def test_chain_widths_pass(tmp_path, hybrid_pair):
    assert _check(tmp_path, hybrid_pair, candidates=[1, 2, 4, 8]).draft_block_size == 8


def test_tree_widths_are_refused_with_the_reason_and_the_fix(tmp_path, hybrid_pair):
    with pytest.raises(ConfigError, match=r"^speculative.adaptive.candidates: widths \[16\] are above the drafter's "
                                          r"block 8, so they verify a DDTree, which has a hybrid target "
                                          r"\(gated-delta-net or mamba layers\).*a state per node.*use widths up to 8"):
        _check(tmp_path, hybrid_pair, candidates=[1, 8, 16])


def test_per_request_widths_are_refused_with_the_reason_and_the_fix(tmp_path, hybrid_pair):
    with pytest.raises(ConfigError, match=r"^speculative.adaptive.per_request_widths: the target is hybrid .*"
                                          r"one width for the whole batch.*set it false"):
        _check(tmp_path, hybrid_pair, candidates=[1, 2, 4, 8], per_request_widths=True)


@pytest.mark.parametrize("config,hybrid", [
    ({"layer_types": ["linear_attention", "full_attention"]}, True),
    ({"text_config": {"layer_types": ["linear_attention", "full_attention"]}}, True),  # Qwen3.5 with vision
    ({"full_attention_interval": 4, "linear_num_value_heads": 32}, True),  # Qwen3-Next: no layer_types
    ({"layer_types": ["full_attention", "sliding_attention"]}, False),
    ({"model_type": "qwen3"}, False),
])
def test_hybrid_is_read_from_the_targets_config(config, hybrid):
    assert refusals.is_hybrid_target(config) is hybrid


def test_a_gpu_is_refused_for_a_hybrid_target_until_it_has_served_there(tmp_path, hybrid_pair):
    data = {"model": {"path": str(hybrid_pair["target"])}, "server": {"device": "cuda"},
            "speculative": {"algorithm": "dflash_adaptive", "draft_model_path": str(hybrid_pair["drafter"])}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=r"^model.path: a hybrid target .* on CPU only.*serve this pair with "
                                          r"speculative.algorithm: dflash"):
        check(load_config(tmp_path / "cfg.yaml"))
