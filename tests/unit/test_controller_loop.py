"""The DFLASH_ADAPTIVE feedback loop without SGLang: what each step is credited with, what reaches the controller
and Prometheus, and that a fault never reaches serving."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from sglang_ext import names
from sglang_ext.controller.config import ControllerConfig
from sglang_ext.controller_loop import ControllerLoop, LaunchedStep
from sglang_ext.metrics import DFlashMetrics, observe_counts
from sglang_ext.settings import AdaptiveSettings

REPO = Path(__file__).resolve().parents[2]
B = 16


@dataclass
class Host:
    """A finished host copy (what a CPU tensor's .numpy() gives once SGLang's copy-done sync passed)."""

    a: np.ndarray

    def numpy(self) -> np.ndarray:
        return self.a


def loop(registry=None, **controller) -> ControllerLoop:
    cfg = ControllerConfig(**({"mode": "fixed", "fixed_block": 4, "cost_sync_interval": 1} | controller))
    metrics = DFlashMetrics("m", B, cfg.candidates_for(B), registry=registry) if registry is not None else None
    return ControllerLoop(AdaptiveSettings(cfg), B, is_rank0=True, metrics=metrics)


def launch(lp: ControllerLoop, rids: list[str], now: float, committed: list[list[int]], drafted=None,
           sampled=None):
    d = lp.begin_decode(rids, now, sampled=sampled)
    step = LaunchedStep(rids, d, None if drafted is None else Host(np.asarray(drafted)),
                        Host(np.asarray(committed)))
    lp.launched(step)
    return d


def written(lp: ControllerLoop) -> None:
    """What the steps counted so far add reaches /metrics (the metrics write every FLUSH_STEPS steps)."""
    lp.metrics.flush()


def steps(reg: CollectorRegistry, b: int) -> float:
    return reg.get_sample_value("dflash_step_seconds_count", {"model_name": "m", "block_size": str(b)}) or 0.0


def test_step_time_is_start_to_start_of_consecutive_decode_steps_only():
    reg = CollectorRegistry()
    lp = loop(reg)
    launch(lp, ["a"], 10.0, [[1, 2, 3, 4]])
    written(lp)
    assert steps(reg, 4) == 0  # the first decode step has no predecessor
    launch(lp, ["a"], 10.5, [[1, 2, 3, 4]])
    written(lp)
    assert steps(reg, 4) == 1
    assert reg.get_sample_value("dflash_step_seconds_sum", {"model_name": "m", "block_size": "4"}) == 0.5
    lp.interrupt()  # a prefill ran in between: the next interval is not a decode step's
    launch(lp, ["a", "b"], 20.0, [[1, 2, 3, 4], [5, 6, 7, 8]])
    written(lp)
    assert steps(reg, 4) == 1


def test_results_reach_the_controller_in_launch_order_and_stale_steps_are_dropped():
    reg = CollectorRegistry()
    lp = loop(reg)
    launch(lp, ["a", "b"], 1.0, [[1, 2, 3, 4], [5, 6, 7, 8]])
    launch(lp, ["a"], 2.0, [[1, 2, 3, 4]])
    lp.complete([1], batch_size=1)  # SGLang never processed the 2-request step: it is dropped, not misread
    written(lp)
    value = reg.get_sample_value
    assert value("dflash_verify_steps_total", {"model_name": "m"}) == 1
    assert value("dflash_accepted_tokens_total", {"model_name": "m"}) == 1
    lp.complete([3], batch_size=1)  # nothing pending: ignored
    written(lp)
    assert value("dflash_verify_steps_total", {"model_name": "m"}) == 1


def test_a_controller_fault_is_counted_and_serving_goes_on():
    reg = CollectorRegistry()
    lp = loop(reg)
    launch(lp, ["a"], 1.0, [[1, 2]])  # committed rows narrower than the accept count claims
    lp.controller.observe_step = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))
    lp.complete([3], batch_size=1)
    assert reg.get_sample_value("dflash_controller_errors_total", {"model_name": "m"}) == 1
    assert launch(lp, ["a"], 2.0, [[1, 2, 3, 4]]).block_size == 4


def test_accepted_drafts_raise_the_acceptance_estimate_and_finished_requests_are_forgotten():
    lp = loop(None, mode="fixed", fixed_block=B)
    prior = lp.controller.stats.global_p().copy()
    block = list(range(1, B + 1))
    d = launch(lp, ["a"], 0.0, [block], drafted=[block[:-1]])  # every draft accepted, then the bonus
    assert d.draft_full and d.block_size == B
    lp.request_finished("a")  # finished while its step was in flight
    lp.complete([B - 1], batch_size=1)
    assert "a" not in lp.controller.slots  # forgotten, not resurrected by the late result
    assert (lp.controller.stats.global_p() > prior).all()


def test_each_steps_sampled_requests_feed_their_own_prior_class():
    """What begin_decode was told about a batch reaches the controller with that step's results, even when the
    next step (another batch) was launched before they arrived."""
    lp = loop(None, mode="fixed", fixed_block=B)
    block = list(range(1, B + 1))
    launch(lp, ["g", "s"], 0.0, [block, block], drafted=[block[:-1]] * 2, sampled=[False, True])
    launch(lp, ["g"], 1.0, [block], drafted=[block[:-1]])  # in flight before the first step's results
    lp.complete([B - 1, B - 1], batch_size=2)
    lp.complete([B - 1], batch_size=1)
    stats = lp.controller.stats
    assert list(stats.slot_class[lp.controller.slots.lookup(["g", "s"])]) == [0, 1]
    # s's one observation to class 1 (absent from the second step: not decayed), g's two to class 0
    assert stats._n_g[1, 0] == 1.0 and stats._n_g[0, 0] == pytest.approx(1.0 + lp.controller.cfg.global_decay)


def test_cost_table_is_broadcast_from_rank0_at_the_sync_interval():
    sent = []
    cfg = ControllerConfig(mode="fixed", fixed_block=4, cost_sync_interval=2)
    lp = ControllerLoop(AdaptiveSettings(cfg), B, is_rank0=True, broadcast=lambda obj: sent.append(obj) or obj)
    for t in range(4):
        launch(lp, ["a"], float(t), [[1, 2, 3, 4]])
        lp.complete([3], batch_size=1)
    assert len(sent) == 2


def test_candidates_wider_than_the_drafter_are_refused_not_dropped():
    with pytest.raises(ValueError, match=r"^candidates: \[65\] exceed 64"):
        ControllerLoop(AdaptiveSettings(ControllerConfig(candidates=(1, 65))), B, is_rank0=True)


def test_without_cost_learning_the_loop_neither_learns_nor_explores():
    settings = AdaptiveSettings(ControllerConfig(), learn_costs=False)
    lp = ControllerLoop(settings, B, is_rank0=True)
    assert lp.controller.cfg.explore_margin == 0.0
    table = lp.controller.cost_model.table.copy()
    for t in range(40):
        launch(lp, ["a"], t * 1.0, [[1] * lp.controller.decide(["a"]).block_size])
    np.testing.assert_array_equal(lp.controller.cost_model.table, table)


def test_the_loop_imports_neither_torch_nor_sglang():
    code = ("import sys, json; import sglang_ext.controller_loop; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'sglang'))))")
    env = {k: v for k, v in os.environ.items() if k != names.CPU}  # an earlier test may have activated the CPU layer
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


DEVICE_SECONDS = {1: 0.010, 2: 0.013, 4: 0.020, 8: 0.031, 16: 0.050}
HOST = 0.001


def mean_step(reg: CollectorRegistry, b: int) -> float:
    labels = {"model_name": "m", "block_size": str(b)}
    return reg.get_sample_value("dflash_step_seconds_sum", labels) / reg.get_sample_value(
        "dflash_step_seconds_count", labels)


def run_overlap_scheduler(lp: ControllerLoop, kinds: str) -> list[int]:
    """SGLang's event_loop_overlap with a fake clock: launch step k, then wait for step k - 1 on the device and
    process it, then launch k + 1. `kinds`: 'd' decode, 'p' prefill (its device time 0.2 s). Returns widths."""
    t, device_free, done, widths = 0.0, 0.0, [], []
    for kind in kinds:
        if kind == "d":
            b = launch(lp, ["a"], t, [[1] * 16]).block_size
            lp.complete([0], batch_size=1)
            seconds = DEVICE_SECONDS[b]
        else:
            lp.interrupt()
            b, seconds = 0, 0.2
        widths.append(b)
        device_free = max(device_free, t) + seconds
        done.append(device_free)
        t = (done[-2] if len(done) >= 2 else t) + HOST  # the host waited for the previous step
    return widths


def test_under_the_overlap_scheduler_each_interval_is_credited_to_the_step_it_measures():
    reg = CollectorRegistry()
    lp = ControllerLoop(AdaptiveSettings(ControllerConfig(mode="cycle", cost_sync_interval=1)), B, is_rank0=True,
                        metrics=DFlashMetrics("m", B, ControllerConfig().candidates_for(B), registry=reg),
                        overlap=True)
    widths = run_overlap_scheduler(lp, "d" * 40)
    assert set(widths) == set(DEVICE_SECONDS)  # the width changes every step
    for b, seconds in DEVICE_SECONDS.items():
        assert mean_step(reg, b) == pytest.approx(seconds)  # crediting the launch after would mix the widths


def test_under_the_overlap_scheduler_a_prefill_is_never_a_decode_sample():
    reg = CollectorRegistry()
    lp = loop(reg, mode="fixed", fixed_block=4)
    lp = ControllerLoop(lp.settings, B, is_rank0=True, metrics=lp.metrics, overlap=True)
    run_overlap_scheduler(lp, "ddpddd")
    written(lp)
    # launches d0 d1 p d2 d3 d4: only [t3, t4] spans decode steps alone, and it measures d2
    assert steps(reg, 4) == 1
    assert mean_step(reg, 4) == pytest.approx(DEVICE_SECONDS[4])


def test_without_overlap_the_same_clock_credits_the_previous_launch():
    reg = CollectorRegistry()
    lp = loop(reg, mode="cycle")
    t = 0.0
    for _ in range(20):  # the host processes each step before it launches the next
        b = launch(lp, ["a"], t, [[1] * 16]).block_size
        lp.complete([0], batch_size=1)
        t += DEVICE_SECONDS[b] + HOST
    written(lp)
    for b, seconds in DEVICE_SECONDS.items():
        assert mean_step(reg, b) == pytest.approx(seconds + HOST)


def test_probes_are_counted_apart_from_width1_steps():
    """dflash_probe_steps_total: the width-1 steps that drafted anyway (what speculation-off pays to keep watching)."""
    reg = CollectorRegistry()
    lp = loop(reg, mode="adaptive", explore_margin=0.0, probe_interval=4, probe_near_interval=0)
    cost = lp.controller.cost_model
    cost.load({"version": 1, "batch_buckets": list(cost.batch_buckets), "block_sizes": list(cost.block_sizes),
               "seconds": [[0.001] + [1.0] * (len(cost.block_sizes) - 1)] * len(cost.batch_buckets)})
    probes = (3, 7, 15)  # every 4 steps, then twice as far: nothing new found (probes.py)
    drafted = [launch(lp, ["a"], 10.0 + i, [[7]], drafted=np.full((1, B - 1), 9) if i in probes else None).draft_full
               for i in range(16)]
    for _ in range(16):  # results arrive in launch order, one per step
        lp.complete([0], 1)
    assert [i for i, d in enumerate(drafted) if d] == list(probes)
    written(lp)
    labels = {"model_name": "m"}
    assert reg.get_sample_value("dflash_probe_steps_total", labels | {"block_size": "1"}) == 3
    assert reg.get_sample_value("dflash_block_size_steps_total", labels | {"block_size": "1"}) == 16


def test_tree_steps_count_the_tokens_committed_past_the_greedy_chain_and_teach_every_narrower_tree(monkeypatch):
    """dflash_tree_extra_tokens_total: per request, the accepted tokens beyond the greedy draft's agreement with the
    committed stream (what the tree bought over the chain of the same draft); offered drafts are the tree's nodes.
    The walked path also tells the controller what the narrower tree candidates would have accepted."""
    import sglang_ext.controller_loop as loop_module

    monkeypatch.setattr(loop_module, "MODEL_PUBLISH_SECONDS", 0.0)
    reg = CollectorRegistry()
    cfg = ControllerConfig(mode="fixed", candidates=(1, 16, 20, 32), fixed_block=32, cost_sync_interval=1)
    lp = ControllerLoop(AdaptiveSettings(cfg), B, is_rank0=True,
                        metrics=DFlashMetrics("m", B, cfg.candidates_for(B), registry=reg))
    d = lp.begin_decode(["a", "b"], 1.0)
    assert d.block_size == 32 and d.draft_full
    drafted = np.array([[5, 6, 7] + [0] * 12, [5, 6, 7] + [0] * 12])
    # a: the chain agreed on 1 token, the tree walked 3 (2 extra); b: the chain agreed on all 3 the tree walked
    committed = np.array([[5, 9, 9, 4] + [0] * 12, [5, 6, 7, 4] + [0] * 12])
    # a's path: nodes 0, 3, 25 (the tree of 19 prefixes holds the first two); b's: 0, 1, 2
    path = np.array([[0, 3, 25] + [-1] * 12, [0, 1, 2] + [-1] * 12])
    lp.launched(LaunchedStep(["a", "b"], d, Host(drafted), Host(committed), tree_path=Host(path)))
    lp.complete([3, 3], 2)
    written(lp)
    labels = {"model_name": "m", "budget": "31"}
    assert reg.get_sample_value("dflash_tree_steps_total", labels) == 1
    assert reg.get_sample_value("dflash_tree_extra_tokens_total", labels) == 2
    assert reg.get_sample_value("dflash_draft_tokens_total", {"model_name": "m"}) == 2 * 31
    gain = lp.controller.tree_gain[0]  # greedy requests
    assert gain.steps.tolist() == [1, 1]  # both tree widths measured by one step of the wider
    # width 20 would have accepted 2 (a) and 3 (b), width 32 3 and 3: one token more over 2 request-steps, against
    # the same expected chain tokens, shrunk by the prior of 8 request-steps
    assert gain.extra()[1] - gain.extra()[0] == pytest.approx(1 / 10)
    assert reg.get_sample_value("dflash_tree_expected_extra_tokens",
                                {**labels, "sampling": "greedy"}) == pytest.approx(gain.extra()[1])
    assert reg.get_sample_value("dflash_tree_expected_extra_tokens", {**labels, "sampling": "sampled"}) == 0


def _committed_exposition(values: list[int], bulk: bool, tmp_path=None) -> dict:
    from prometheus_client import Histogram

    reg = CollectorRegistry()
    h = Histogram("h", "h", buckets=tuple(float(k) for k in range(1, B + 1)), registry=reg)
    if bulk:
        observe_counts(h, np.bincount(np.asarray(values, dtype=np.int64), minlength=B + 1))
    else:
        for v in values:
            h.observe(v)
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for m in reg.collect() for s in m.samples
            if not s.name.endswith("_created")}


def test_bulk_committed_histogram_exposes_what_one_observe_per_request_would():
    """The committed-tokens histogram is written per bucket (one write per distinct value, not per request): its
    buckets, sum and count must read exactly as one Histogram.observe per request -- this pins the prometheus_client
    internals observe_counts writes."""
    values = [1, 1, 3, 16, 1, 7, 7, 2, 16]
    assert _committed_exposition(values, bulk=True) == _committed_exposition(values, bulk=False)
    assert _committed_exposition([], bulk=True) == _committed_exposition([], bulk=False)


def test_bulk_step_time_histogram_exposes_what_one_observe_per_step_would():
    """Step times are written per bucket at a flush (observe_values): values on a bucket's bound, between bounds and
    past the last one read exactly as one Histogram.observe each."""
    from prometheus_client import Histogram

    from sglang_ext.metrics import _STEP_BUCKETS, observe_values

    values = [0.0005, 0.016, 0.0161, 9.0, 0.0001, 0.016, 2.5]
    out = []
    for bulk in (True, False):
        reg = CollectorRegistry()
        h = Histogram("h", "h", buckets=_STEP_BUCKETS, registry=reg)
        if bulk:
            observe_values(h, np.asarray(values))
        else:
            for v in values:
                h.observe(v)
        out.append({(s.name, tuple(sorted(s.labels.items()))): s.value for m in reg.collect() for s in m.samples
                    if not s.name.endswith("_created")})
    assert out[0] == out[1]


@pytest.mark.parametrize("plain", [False, True])
def test_width1_steps_count_their_requests_and_one_token_each(plain):
    """A width-1 step (speculation off) is still a verify step of every request committing one token; its
    zero draft and zero accepted counts are not written, yet read 0 (the series exist from start-up). A step run as
    plain decoding (``plain``: observed without its arrays) counts the same, and as a plain step."""
    reg = CollectorRegistry()
    lp = loop(reg, mode="fixed", fixed_block=1)
    for i in range(3):
        d = lp.begin_decode(["a", "b"], 1.0 + i)
        lp.launched(LaunchedStep(["a", "b"], d, None, Host(np.asarray([[5], [6]])), plain=plain))
        lp.complete([0, 0], 2)
    assert lp.controller.steps_observed == 3
    lp.request_finished("a")  # writes the width-1 steps counted in process
    value = reg.get_sample_value
    labels = {"model_name": "m"}
    assert value("dflash_verify_steps_total", labels) == 6
    assert value("dflash_draft_tokens_total", labels) == 0
    assert value("dflash_accepted_tokens_total", labels) == 0
    assert value("dflash_block_size", labels) == 1
    assert value("dflash_committed_tokens_per_step_count", labels) == 6
    assert value("dflash_committed_tokens_per_step_sum", labels) == 6
    assert value("dflash_committed_tokens_per_step_bucket", labels | {"le": "1.0"}) == 6
    assert value("dflash_plain_decode_steps_total", labels) == (3 if plain else 0)
    assert value("dflash_block_size_steps_total", labels | {"block_size": "1"}) == 3


def test_steps_reach_metrics_at_most_a_flush_interval_late_and_before_a_finished_requests_answer():
    """Decode steps are counted in process (FLUSH_STEPS): on /metrics at most that many steps late, whatever their
    width, and as soon as a request finishes (SGLang then sends its answer); the width gauge moves at once."""
    from sglang_ext.metrics import FLUSH_STEPS as N

    reg = CollectorRegistry()
    lp = loop(reg, mode="schedule", schedule={1: 1, 2: 4})
    value = lambda name, **labels: reg.get_sample_value(name, {"model_name": "m", **labels}) or 0.0
    steps_at = lambda b: value("dflash_block_size_steps_total", block_size=str(b))
    t = 1.0
    for _ in range(N - 1):
        launch(lp, ["a"], t, [[5]])
        lp.complete([0], 1)
        t += 1.0
    assert steps_at(1) == 0 and value("dflash_block_size") == 1  # N - 1 counted in process; the gauge at once
    launch(lp, ["a", "b"], t, [[5, 6, 7, 8], [5, 9, 7, 8]])  # batch of 2: width 4, the N-th step
    lp.complete([2, 0], 2)
    assert steps_at(1) == N - 1 and steps_at(4) == 1  # the N-th counted step wrote them all
    assert value("dflash_tried_tokens_by_position_total", position="1") == 2
    assert value("dflash_accepted_tokens_by_position_total", position="2") == 1
    assert value("dflash_step_seconds_count", block_size="1") == N - 1  # start to start, each at the next launch
    for _ in range(3):
        t += 1.0
        launch(lp, ["a"], t, [[5]])
        lp.complete([0], 1)
    assert steps_at(1) == N - 1 and value("dflash_block_size") == 1
    lp.request_finished("a")
    assert steps_at(1) == N + 2
    assert value("dflash_verify_steps_total") == N + 2 + 2
    assert value("dflash_committed_tokens_per_step_count") == N + 2 + 2
    assert value("dflash_committed_tokens_per_step_sum") == N + 2 + (3 + 1)
    assert value("dflash_step_seconds_count", block_size="4") == 1
    assert value("dflash_step_seconds_count", block_size="1") == N + 1  # the last step's comes with the next launch




def test_ragged_steps_are_counted_by_request_width_and_kept_out_of_the_cost_table():
    """A ragged step (per-request widths): its requests count at their own widths, each position's chances only
    where a request's width reached it, its time under block_size="ragged", never in a width's cost cell: in the
    learner's line of ragged steps (ragged_price.py), at its mean width."""
    reg = CollectorRegistry()
    lp = loop(reg, mode="cycle", candidates=[1, 4, 16], cycle_pattern=[16, 1, 4], per_request_widths=True)
    table = lp.controller.cost_model.table.copy()
    for i in range(3):  # widths (16, 1, 4), (1, 4, 16), (4, 16, 1)
        d = lp.begin_decode(["a", "b", "c"], 10.0 + i, ragged=True)
        assert d.widths is not None and sorted(d.widths) == [1, 4, 16]
        w = list(d.widths)
        acc = [min(2, x - 1) for x in w]
        committed = np.zeros((3, d.block_size), dtype=np.int64)  # [bs, widest]: a row is read up to acc + 1
        lp.launched(LaunchedStep(["a", "b", "c"], d, None, Host(committed)))
        lp.complete(acc, 3)
    lp.begin_decode(["a"], 13.0, ragged=True)  # one request: batch-wide; closes the last ragged step's interval
    written(lp)
    labels = {"model_name": "m"}
    value = lambda name, **lab: reg.get_sample_value(name, labels | lab)  # noqa: E731
    assert value("dflash_ragged_steps_total") == 3
    assert [value("dflash_ragged_request_steps_total", block_size=str(b)) for b in (1, 4, 16)] == [3, 3, 3]
    assert value("dflash_block_size_steps_total", block_size="16") == 0
    # accepted 2 at widths 4 and 16, 0 at width 1: positions 1-3 tried by 6 requests (3 of width 1 tried none)
    assert [value("dflash_tried_tokens_by_position_total", position=str(j)) for j in (1, 2, 3, 4)] == [6, 6, 6, 0]
    assert value("dflash_draft_tokens_total") == 3 * (0 + 3 + 15)
    assert value("dflash_accepted_tokens_total") == 12
    assert reg.get_sample_value("dflash_step_seconds_count", labels | {"block_size": "ragged"}) == 3
    np.testing.assert_array_equal(lp.controller.cost_model.table, table)
    cost = lp.controller.cost_model
    steps, weight, sx = cost.export()["ragged"][cost.bucket_index(3)][:3]
    assert steps == 3 and sx / weight == pytest.approx(7.0)  # three steps of 21 rows for 3 requests


def test_live_request_states_gauge_returns_to_zero_on_every_exit_path():
    """dflash_live_request_states counts the controller's per-request states: each request that leaves -- finished,
    or ended while its last step is still in flight (an abort, a retraction abort) -- frees its state."""
    reg = CollectorRegistry()
    lp = loop(reg)
    live = lambda: reg.get_sample_value("dflash_live_request_states", {"model_name": "m"})
    launch(lp, ["a", "b", "c"], 1.0, [[1, 2, 3, 4]] * 3)
    lp.complete([3, 3, 3], 3)
    lp.request_finished("a")
    assert live() == 2 == lp.controller.live_requests
    launch(lp, ["b", "c"], 2.0, [[1, 2, 3, 4]] * 2)
    lp.request_finished("b")  # aborted while its step is in flight: its feedback must not bring its state back
    lp.complete([3, 3], 2)
    assert live() == 1 == lp.controller.live_requests
    lp.request_finished("c")
    assert live() == 0 == lp.controller.live_requests


def test_plain_runs_decide_and_learn_what_the_controller_fed_step_by_step_does():
    """Plain steps folded as runs (module docstring) change nothing the controller decides or learns: the same
    traffic fed to a controller step by step by its worker contract (decide, observe, step time, sync) takes the
    same decisions and ends with the same acceptance counts, steps and learnt cost table."""
    from sglang_ext.controller.cost_model import CostModel
    from sglang_ext.controller.policy import BlockSizeController

    cfg = ControllerConfig()
    lp = ControllerLoop(AdaptiveSettings(cfg), B, is_rank0=True, prefix_drafts=True)
    ref = BlockSizeController(cfg, CostModel.default(cfg.candidates_for(B), ema=cfg.cost_ema), max_block=B,
                              prefix_drafts=True)
    rng = np.random.default_rng(1)
    live: dict[str, float] = {}
    t, prev, ids, runs_seen, plain_steps = 0.0, None, 0, 0, 0
    got, want = [], []
    for i in range(3000):
        if not live or (rng.random() < 0.03 and len(live) < 6):
            live[f"r{ids}"] = 0.0 if rng.random() < 0.75 else float(rng.uniform(0.5, 0.95))
            ids += 1
        if len(live) > 1 and rng.random() < 0.02:
            gone = sorted(live)[int(rng.integers(len(live)))]
            del live[gone]
            lp.request_finished(gone)
            ref.finish(gone)
        rids = sorted(live)
        bs = len(rids)
        d = lp.begin_decode(list(rids), t)
        if prev is not None:
            ref.observe_step_time(prev[0], prev[1].block_size, t - prev[2], probe=prev[1].probe)
        r = ref.decide(list(rids))
        got.append((d.block_size, d.draft_full, d.probe))
        want.append((r.block_size, r.draft_full, r.probe))
        b = d.block_size
        # what each request accepts at this width: its acceptance, drawn position by position
        p = np.array([live[x] for x in rids])
        would = (rng.random((bs, B - 1)) < p[:, None]).cumprod(axis=1).sum(axis=1)
        accepted = np.minimum(would, min(b, B) - 1)
        truth = rng.integers(10, 1000, (bs, B))
        drafted = np.where(np.arange(B - 1)[None, :] < would[:, None], truth[:, :B - 1], 0) if d.draft_full else None
        committed = truth[:, :min(b, B)]
        plain = b == 1 and not d.draft_full
        plain_steps += plain
        lp.launched(LaunchedStep(list(rids), d, None if drafted is None else Host(drafted), Host(committed),
                                 plain=plain))
        runs_seen += lp._run is not None
        lp.complete(accepted.tolist(), bs)
        if not (plain and ref.observe_plain(list(rids))):
            rows = [row[: a + 1] for row, a in zip(committed, accepted)]
            ref.observe_step(list(rids), b, accepted, drafted, rows)
        if ref.cost_sync_due:
            ref.sync_cost_table()
        prev = (bs, d, t)
        t += 0.004 * bs * (1 + 0.2 * (b > 1) + 0.05 * min(b, B)) * (1 + 0.1 * rng.random())
    lp._fold()
    ctl = lp.controller
    assert plain_steps > 1000 and runs_seen > 1000  # mostly plain, and most of them joined runs
    assert got == want
    assert ctl.steps_observed == ref.steps_observed
    ctl.stats.flush_decay()
    ref.stats.flush_decay()
    np.testing.assert_allclose(ctl.stats.a_r, ref.stats.a_r, rtol=1e-12)
    np.testing.assert_allclose(ctl.stats.n_r, ref.stats.n_r, rtol=1e-12)
    assert json.dumps(ctl.cost_model.export()) == json.dumps(ref.cost_model.export())


def test_plain_runs_reach_metrics_within_a_run_and_a_flush_and_before_a_finished_requests_answer():
    """Plain steps counted as a run (module docstring) are on /metrics at most RUN_STEPS + FLUSH_STEPS steps late,
    and all of them once a request finishes, each with its step time."""
    from sglang_ext.controller_loop import RUN_STEPS
    from sglang_ext.metrics import FLUSH_STEPS

    reg = CollectorRegistry()
    lp = loop(reg, mode="fixed", fixed_block=1, cost_sync_interval=10_000)
    value = lambda name, **labels: reg.get_sample_value(name, {"model_name": "m", **labels}) or 0.0
    t, n = 1.0, 0
    for _ in range(3 * (RUN_STEPS + FLUSH_STEPS)):
        d = lp.begin_decode(["a", "b"], t)
        lp.launched(LaunchedStep(["a", "b"], d, None, Host(np.asarray([[5], [6]])), plain=True))
        lp.complete([0, 0], 2)
        n, t = n + 1, t + 0.01
        assert value("dflash_plain_decode_steps_total") >= n - (RUN_STEPS + FLUSH_STEPS)
    assert lp._run is not None and lp._run.steps > 0  # a run is open: steps are counted, not yet written
    lp.request_finished("a")
    assert value("dflash_plain_decode_steps_total") == n
    assert value("dflash_verify_steps_total") == 2 * n
    assert value("dflash_committed_tokens_per_step_sum") == 2 * n
    assert value("dflash_step_seconds_count", block_size="1") == n - 1  # the last one's comes with the next launch
    assert lp.controller.steps_observed == n
