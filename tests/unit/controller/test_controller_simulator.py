"""Simulator and roofline: determinism, sanity of the physics, the oracle, profile validation."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sglang_ext.controller import ControllerConfig
from sglang_ext.controller.roofline import RooflineProfile
from harness.simulator import SimConfig, oracle_blocks, run, steady_context_per_request
from harness.workload import FAMILIES, tau_at

PROFILE = Path(__file__).resolve().parents[3] / "sglang_ext" / "controller" / "profiles" / "h200_qwen3_8b.json"


@pytest.fixture(scope="module")
def prof() -> RooflineProfile:
    return RooflineProfile.from_dict(json.loads(PROFILE.read_text()))


def test_roofline_is_monotone_and_plausible(prof: RooflineProfile) -> None:
    for B in (1, 8, 64):
        t = [prof.step_time(B, b, B * 1024) for b in (1, 2, 4, 8, 16)]
        assert all(x <= y for x, y in zip(t, t[1:]))
    # b=1 at batch 1 is weight-bandwidth bound: 16 GB at ~3.8 TB/s effective plus overhead, ~5 ms
    assert 0.004 < prof.step_time(1, 1, 1024) < 0.007
    assert prof.step_time(64, 16, 64 * 1024) > 3 * prof.step_time(64, 2, 64 * 1024) / 2  # compute bound
    assert prof.step_time(8, 1, 0.0, drafted=True) > prof.step_time(8, 1, 0.0)  # a probe costs a draft


def test_profile_errors_name_the_field() -> None:
    d = json.loads(PROFILE.read_text())
    del d["target"]["kv_bytes_per_token"]
    with pytest.raises(ValueError, match=r"^target\.kv_bytes_per_token:"):
        RooflineProfile.from_dict(d)
    d = json.loads(PROFILE.read_text())
    d["hardware"]["roofline_smoothness"] = 0.5
    with pytest.raises(ValueError, match=r"^hardware\.roofline_smoothness:"):
        RooflineProfile.from_dict(d)


def test_family_calibration_matches_published_acceptance() -> None:
    assert 6.0 <= tau_at(FAMILIES["math"]) <= 7.0  # DFlash on math/code: ~6.5 at block 16
    assert 6.0 <= tau_at(FAMILIES["code"]) <= 7.5
    assert 3.0 <= tau_at(FAMILIES["chat"]) <= 4.0  # chat: 3-4
    assert 1.03 <= tau_at(FAMILIES["prose"]) <= 1.1  # the bundled CPU pair on prose: 1.05-1.08 at any width


def test_runs_are_deterministic_and_fixed_b1_matches_physics(prof: RooflineProfile) -> None:
    sim = SimConfig(family="math", concurrency=4, duration_s=1.5, warmup_s=0.2, seed=3)
    a = run(sim, prof, ControllerConfig(mode="fixed", fixed_block=1))
    b = run(sim, prof, ControllerConfig(mode="fixed", fixed_block=1))
    assert repr(a) == repr(b)  # (nan-safe equality)
    assert a.mean_block == 1.0 and a.switches == 0
    # plain decoding: 4 tokens per ~5 ms step
    assert 600 < a.tokens_per_s < 900


def test_adaptive_beats_plain_decoding_and_tracks_the_best_fixed_block(prof: RooflineProfile) -> None:
    sim = SimConfig(family="math", concurrency=1, duration_s=3.0, warmup_s=0.5, seed=11)
    ad = run(sim, prof, ControllerConfig())
    fixed = {b: run(sim, prof, ControllerConfig(mode="fixed", fixed_block=b)).tokens_per_s for b in (1, 16)}
    assert ad.tokens_per_s > 3.0 * fixed[1]
    assert ad.tokens_per_s > 0.95 * fixed[16]


def test_poisson_arrivals_and_schedule_mode(prof: RooflineProfile) -> None:
    sim = SimConfig(family="chat", concurrency=8, arrival="poisson", rate_rps=20.0, max_running=8,
                    duration_s=2.0, warmup_s=0.2, seed=5)
    orc = oracle_blocks(prof, "chat", (1, 2, 4, 8, 16), range(1, 9), steady_context_per_request(sim))
    assert set(orc) == set(range(1, 9)) and set(orc.values()) <= {1, 2, 4, 8, 16}
    r = run(sim, prof, ControllerConfig(mode="schedule", schedule=orc))
    assert 0 < r.mean_batch <= 8 and r.tokens_per_s > 0


def test_oracle_prefers_smaller_blocks_under_load(prof: RooflineProfile) -> None:
    sim = SimConfig()
    orc = oracle_blocks(prof, "chat", (1, 2, 4, 8, 16), (1, 64), steady_context_per_request(sim))
    assert orc[1] >= orc[64]
    assert np.isfinite(steady_context_per_request(sim))
