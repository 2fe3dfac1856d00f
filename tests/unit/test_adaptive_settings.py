"""speculative.adaptive: bad controller settings are refused at load or preflight with the field named; good ones
reach the scheduler process intact (environment JSON); the worker's metric arithmetic."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from service.config import ConfigError, parse_config
from service.launcher import server_env
from service.preflight import check
from sglang_ext.metrics import DFlashMetrics
from sglang_ext.names import ADAPTIVE as ENV_VAR
from sglang_ext.settings import AdaptiveSettings


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from dflash_models import tiny

    return tiny.build(tmp_path_factory.mktemp("pair"), log=lambda *_: None)


def config(pair, **adaptive):
    return {"model": {"path": str(pair["target"])},
            "speculative": {"algorithm": "dflash_adaptive", "draft_model_path": str(pair["drafter"]),
                            **({"adaptive": adaptive} if adaptive else {})}}


@pytest.mark.parametrize("adaptive, message", [
    ({"hysteresis": 2}, "speculative.adaptive.hysteresis: must be a number in [0, 1)"),
    ({"candidates": [4, 2]}, "speculative.adaptive.candidates: must be strictly increasing"),
    ({"mode": "fixed"}, "speculative.adaptive.fixed_block: is required when mode is 'fixed'"),
    ({"mode": "fixed", "fixed_block": 3, "candidates": [1, 2, 4]},
     "speculative.adaptive.fixed_block: 3 is not one of the candidates"),
    ({"mode": "schedule", "schedule": {1: 16, 8: 3}, "candidates": [1, 16]},
     "speculative.adaptive.schedule: block 3 for batch size 8"),
    ({"decay": 0}, "speculative.adaptive.decay: must be a number in (0, 1]"),
    ({"probe_interval": -1}, "speculative.adaptive.probe_interval"),
    ({"mode": "fastest"}, "speculative.adaptive.mode"),
    ({"hysterisis": 0.1}, "speculative.adaptive.hysterisis: unknown key"),
])
def test_bad_controller_settings_refused_at_load(pair, adaptive, message):
    with pytest.raises(ConfigError) as e:
        parse_config(config(pair, **adaptive))
    assert str(e.value).startswith(message), str(e.value)


def test_block_size_and_adaptive_section_belong_to_their_algorithms(pair):
    cfg = config(pair)
    cfg["speculative"]["block_size"] = 8
    with pytest.raises(ConfigError, match=r"^speculative: block_size is not used by dflash_adaptive"):
        parse_config(cfg)
    cfg = config(pair, hysteresis=0.1)
    cfg["speculative"]["algorithm"] = "dflash"
    with pytest.raises(ConfigError, match=r"^speculative: adaptive settings need algorithm: dflash_adaptive"):
        parse_config(cfg)


@pytest.mark.parametrize("adaptive, message", [
    ({"candidates": [1, 4, 80]}, "speculative.adaptive.candidates: [80] exceed 64 = 4 x the drafter's trained "
                                 "block_size 16"),
    ({"mode": "fixed", "fixed_block": 3}, "speculative.adaptive.fixed_block: 3 is not one of the candidates "
                                          "(1, 2, 4, 8, 16)"),  # auto candidates: known once the drafter is
    ({"mode": "schedule", "schedule": {1: 16, 8: 3}}, "speculative.adaptive.schedule: block 3 for batch size 8"),
    ({"cost_profile": "missing.json"}, "speculative.adaptive.cost_profile:"),
])
def test_settings_that_need_the_drafter_refused_at_preflight(pair, tmp_path, adaptive, message):
    cfg = parse_config(config(pair, **adaptive), base=tmp_path)
    with pytest.raises(ConfigError) as e:
        check(cfg)
    assert str(e.value).startswith(message), str(e.value)


def test_unusable_cost_profile_refused_at_preflight(pair, tmp_path):
    (tmp_path / "p.json").write_text(json.dumps({"batch_buckets": [1, 8], "block_sizes": [1, 16],
                                                 "seconds": [[0.01, 0.02]]}))
    cfg = parse_config(config(pair, cost_profile="p.json"), base=tmp_path)
    with pytest.raises(ConfigError, match=r"^speculative.adaptive.cost_profile: .* not a usable cost profile"):
        check(cfg)


def test_settings_reach_the_worker_through_the_environment(pair, tmp_path):
    (tmp_path / "p.json").write_text(json.dumps({"batch_buckets": [1, 8], "block_sizes": [1, 16],
                                                 "seconds": [[0.01, 0.02], [0.02, 0.08]]}))
    cfg = parse_config(config(pair, mode="schedule", schedule={1: 16, 8: 1}, hysteresis=0.1,
                              cost_profile="p.json", learn_costs=False), base=tmp_path)
    check(cfg)
    env = server_env(cfg, base={ENV_VAR: "stale"})
    got = AdaptiveSettings.from_env(env)
    assert got.controller.mode == "schedule" and got.controller.schedule_map() == {1: 16, 8: 1}
    assert got.controller.hysteresis == 0.1 and got.learn_costs is False
    assert Path(got.cost_profile) == tmp_path / "p.json"
    plain = parse_config({"model": {"path": str(pair["target"])}})
    assert ENV_VAR not in server_env(plain, base={ENV_VAR: "stale"})  # never leaks into another algorithm


def test_environment_settings_errors_name_the_problem():
    with pytest.raises(ValueError, match=ENV_VAR):
        AdaptiveSettings.from_env({ENV_VAR: "{not json"})
    with pytest.raises(ValueError, match="^hysteresis: "):
        AdaptiveSettings.from_env({ENV_VAR: json.dumps({"controller": {"hysteresis": -1}})})
    assert AdaptiveSettings.from_env({}) == AdaptiveSettings()


def _value(reg: CollectorRegistry, name: str, **labels) -> float:
    v = reg.get_sample_value(name, {"model_name": "m", **labels})
    return 0.0 if v is None else v


def test_metrics_count_request_steps_positions_and_widths():
    reg = CollectorRegistry()
    m = DFlashMetrics("m", 16, (1, 2, 4, 8, 16), registry=reg)
    # a width-4 step of 3 requests accepting 0, 2 and 3 drafts, then a width-1 step of 2 requests
    m.record_step(block_size=4, switched=False, accepted=np.array([0, 2, 3]), predicted_goodput=100.0)
    m.record_step(block_size=1, switched=True, accepted=np.array([0, 0]), predicted_goodput=90.0)
    assert _value(reg, "dflash_block_size") == 1  # the width gauge moves at once; the counts every FLUSH_STEPS steps
    assert _value(reg, "dflash_verify_steps_total") == 0
    m.flush()
    assert _value(reg, "dflash_verify_steps_total") == 5
    assert _value(reg, "dflash_draft_tokens_total") == 3 * 3
    assert _value(reg, "dflash_accepted_tokens_total") == 5
    assert [_value(reg, "dflash_accepted_tokens_by_position_total", position=str(j)) for j in (1, 2, 3, 4)] == [2, 2, 1, 0]
    assert [_value(reg, "dflash_tried_tokens_by_position_total", position=str(j)) for j in (1, 2, 3, 4)] == [3, 2, 2, 0]
    assert _value(reg, "dflash_block_size_steps_total", block_size="4") == 1
    assert _value(reg, "dflash_block_size_steps_total", block_size="1") == 1
    assert _value(reg, "dflash_block_size_switches_total") == 1
    assert _value(reg, "dflash_block_size") == 1 and _value(reg, "dflash_predicted_goodput_tokens_per_second") == 90
    assert _value(reg, "dflash_committed_tokens_per_step_count") == 5
    assert _value(reg, "dflash_committed_tokens_per_step_sum") == 5 + 5
    m.record_step_time(4, 0.01)
    m.record_step_time(4, 0.03)
    m.flush()
    assert _value(reg, "dflash_step_seconds_count", block_size="4") == 2
    assert _value(reg, "dflash_step_seconds_sum", block_size="4") == pytest.approx(0.04)
    assert _value(reg, "dflash_step_seconds_bucket", block_size="4", le="0.016") == 1
    assert _value(reg, "dflash_step_seconds_bucket", block_size="4", le="0.032") == 2
    m.record_model(np.linspace(0.9, 0.1, 15), [1, 8], [1, 16], np.array([[0.01, 0.02], [0.02, np.nan]]))
    assert _value(reg, "dflash_acceptance_probability", position="1") == pytest.approx(0.9)
    assert _value(reg, "dflash_step_cost_seconds", batch_bucket="8", block_size="1") == 0.02
    assert reg.get_sample_value("dflash_step_cost_seconds",
                                {"model_name": "m", "batch_bucket": "8", "block_size": "16"}) is None


def test_dashboard_contract_is_what_the_worker_exports():
    """tests/deploy exercises rules and dashboards against this contract: it must be the worker's real metric set."""
    from tests.deploy.fake_dflash import CONTRACT

    reg = CollectorRegistry()
    DFlashMetrics("m", 16, (1, 2, 4, 8, 16, 32), registry=reg, calibrated=(2, 4, 8)).record_model(
        np.zeros(15), [1], [1], np.ones((1, 1)), np.zeros((2, 1)), np.ones((2, 3)))
    exported = {}
    for family in reg.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = {label for s in family.samples for label in s.labels} - {"model_name", "le"}
        exported[name] = (family.type, labels)
    assert exported == {n: (kind, set(labels)) for n, (kind, labels) in CONTRACT.items()}


def test_on_gpu_adaptive_asks_sglang_to_size_the_kv_pool_after_graph_capture(pair):
    """The per-width verify graphs are captured after SGLang sized the KV pool; post-capture sizing counts them."""
    from sglang_ext.names import SGLANG_POST_CAPTURE_KV_SIZING as POST

    gpu = config(pair)
    gpu["server"] = {"device": "cuda"}
    assert server_env(parse_config(gpu), base={})[POST] == "1"
    assert server_env(parse_config(gpu), base={POST: "0"})[POST] == "0"  # the operator's choice stands
    assert POST not in server_env(parse_config(config(pair)), base={})  # CPU: no graphs
    gpu_plain = {"model": {"path": str(pair["target"])}, "server": {"device": "cuda"}}
    assert POST not in server_env(parse_config(gpu_plain), base={})  # upstream algorithms: upstream's default
