"""ControllerConfig: validation names the field, from_dict/to_dict round-trip, frozen."""

from __future__ import annotations

import dataclasses
import json

import pytest

from sglang_ext.controller import ControllerConfig
from sglang_ext.controller.config import field_docs


def test_defaults_match_the_worker_contract() -> None:
    cfg = ControllerConfig(
        mode="adaptive",
        candidates=None,  # auto: powers of two up to the drafter's block
        hysteresis=0.03,
        min_dwell_steps=8,
        decay=0.99,
        prior_strength=8.0,
        probe_interval=32,
        fixed_block=None,
        schedule=None,
    )
    assert cfg == ControllerConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.mode = "fixed"  # type: ignore[misc]
    hash(cfg)  # canonical containers: hashable


@pytest.mark.parametrize(
    "field,value",
    [
        ("mode", "greedy"),
        ("candidates", ()),
        ("candidates", (2, 1)),
        ("candidates", (0, 1)),
        ("candidates", (1, 1)),
        ("hysteresis", -0.1),
        ("hysteresis", 1.0),
        ("hysteresis", float("nan")),
        ("min_dwell_steps", -1),
        ("min_dwell_steps", 1.5),
        ("decay", 0.0),
        ("decay", 1.5),
        ("global_decay", 0.0),
        ("prior_strength", -1.0),
        ("global_prior_mean", 1.5),
        ("global_prior_strength", 0.0),
        ("probe_interval", -3),
        ("cost_ema", 0.0),
        ("cost_sync_interval", 0),
        ("objective", "myopic"),
        ("explore_margin", 1.0),
        ("explore_stale_measurements", 0),
        ("fixed_block", 3),
        ("fixed_block", 0),
        ("schedule", {"a": 1}),
        ("schedule", {1: 3}),
        ("schedule", {0: 2}),
        ("schedule", "1:2"),
    ],
)
def test_invalid_field_is_named(field: str, value: object) -> None:
    # blocks are checked against listed candidates here, against auto candidates once the drafter is known
    listed = {"candidates": (1, 2, 4, 8, 16)} if field in ("fixed_block", "schedule") else {}
    with pytest.raises(ValueError) as e:
        ControllerConfig(**{field: value}, **listed)
    assert str(e.value).startswith(f"{field}:"), str(e.value)


def test_mode_requirements_name_the_missing_field() -> None:
    with pytest.raises(ValueError, match=r"^fixed_block:"):
        ControllerConfig(mode="fixed")
    with pytest.raises(ValueError, match=r"^schedule:"):
        ControllerConfig(mode="schedule")


def test_from_dict_round_trip_and_json_keys() -> None:
    d = {"mode": "schedule", "candidates": [1, 2, 4, 8], "schedule": {"1": 8, "16": 4, "64": 1}}
    cfg = ControllerConfig.from_dict(d)
    assert cfg.candidates == (1, 2, 4, 8)
    assert cfg.schedule_map() == {1: 8, 16: 4, 64: 1}
    again = ControllerConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg


def test_from_dict_unknown_key_is_named() -> None:
    with pytest.raises(ValueError, match=r"^hysterisis:"):
        ControllerConfig.from_dict({"hysterisis": 0.1})
    with pytest.raises(ValueError, match=r"^config:"):
        ControllerConfig.from_dict([("mode", "fixed")])  # type: ignore[arg-type]


def test_max_block_bounds_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"^fixed_block:"):
        ControllerConfig(mode="fixed", fixed_block=16).check_against_max_block(8)
    with pytest.raises(ValueError, match=r"^fixed_block: 3 is not one of the candidates \(1, 2, 4, 8\)"):
        ControllerConfig(mode="fixed", fixed_block=3).check_against_max_block(8)  # auto candidates
    with pytest.raises(ValueError, match=r"^schedule:"):
        ControllerConfig(mode="schedule", schedule={1: 16}).check_against_max_block(8)
    with pytest.raises(ValueError, match=r"^candidates: \[33\] exceed 32 = 4 x"):  # refused, never dropped
        ControllerConfig(candidates=(1, 4, 16, 33)).check_against_max_block(8)
    tree = ControllerConfig(candidates=(1, 4, 8, 16, 32))  # above the block: trees of 15 and 31 prefixes
    tree.check_against_max_block(8)
    assert tree.tree_widths(8) == (16, 32) and ControllerConfig().tree_widths(8) == ()
    with pytest.raises(ValueError, match=r"^candidates: \[16, 32\] has no chain width \(1..8\)"):
        ControllerConfig(candidates=(16, 32), mode="fixed", fixed_block=32).check_against_max_block(8)
    with pytest.raises(ValueError, match=r"^max_block:"):
        ControllerConfig().check_against_max_block(0)
    ControllerConfig().check_against_max_block(8)


def test_auto_candidates_are_powers_of_two_up_to_the_block() -> None:
    assert ControllerConfig().candidates_for(16) == (1, 2, 4, 8, 16)
    assert ControllerConfig().candidates_for(10) == (1, 2, 4, 8, 10)
    assert ControllerConfig().candidates_for(1) == (1,)
    assert ControllerConfig(candidates=(1, 8)).candidates_for(16) == (1, 8)


def test_cycle_pattern_is_cycle_modes_and_made_of_candidates() -> None:
    assert ControllerConfig.from_dict({"mode": "cycle", "cycle_pattern": [1, 1, 16]}).cycle_pattern == (1, 1, 16)
    with pytest.raises(ValueError, match=r"^cycle_pattern: is used by mode 'cycle' only"):
        ControllerConfig(mode="adaptive", cycle_pattern=(1, 16))
    with pytest.raises(ValueError, match=r"^cycle_pattern: \[3\] are not among the candidates"):
        ControllerConfig(mode="cycle", candidates=(1, 16), cycle_pattern=(1, 3))
    with pytest.raises(ValueError, match=r"^cycle_pattern: \[32\] are not among the candidates"):
        ControllerConfig(mode="cycle", cycle_pattern=(1, 32)).check_against_max_block(16)
    with pytest.raises(ValueError, match=r"^cycle_pattern: must be a non-empty"):
        ControllerConfig(mode="cycle", cycle_pattern=())
    cfg = ControllerConfig(mode="cycle", cycle_pattern=(1, 16))
    assert ControllerConfig.from_dict(cfg.to_dict()) == cfg


def test_every_setting_has_its_own_docstring_for_the_generated_reference() -> None:
    """A settings reference generated from the config prints each field's own docstring: none may be missing."""
    docs = field_docs()
    assert sorted(docs) == sorted(f.name for f in dataclasses.fields(ControllerConfig))
    assert [name for name, doc in docs.items() if len(doc.split()) < 4] == []
