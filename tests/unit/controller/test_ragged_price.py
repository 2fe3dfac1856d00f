"""ragged_price.py: ragged steps' own line, learnt on rank 0 and read only once broadcast; the price it gives a
ragged step (ragged.py), and the controller choosing per-request widths by it."""
from __future__ import annotations

import numpy as np
import pytest

from sglang_ext.controller import BlockSizeController, ControllerConfig, CostModel
from sglang_ext.controller.ragged import assign, ragged_cost
from sglang_ext.controller.ragged_price import MIN_STEPS, RaggedPrice
from tests.unit.controller.test_controller_policy import RAGGED_COST, mixed_controller

BUCKETS = (1, 2, 4, 8, 16, 32)
BLOCKS = (1, 2, 4, 8, 16)
ROW = np.array([RAGGED_COST[b] for b in BLOCKS])  # the batch-wide table: 0.010 + 0.001 b past width 1
TABLE = (np.asarray(BLOCKS, dtype=float), ROW)


def learnt(points: list[tuple[float, float]], ema: float = 0.1) -> RaggedPrice:
    price = RaggedPrice(BUCKETS, ema)
    for m, s in points:
        price.observe(3, m, s, clock=0)
    price.load(price.export(clock=0))
    return price


def table_at(m: np.ndarray) -> np.ndarray:
    return np.interp(m, *TABLE)


def test_steps_spread_over_widths_teach_their_own_line() -> None:
    """Ragged steps costing 0.020 + 0.002 m (twice the table's slope): the fitted line is theirs, not the
    table's, shrunk toward the table's slope only by the ridge."""
    price = learnt([(m, 0.020 + 0.002 * m) for m in (2, 4, 6, 8, 10, 12)])
    line = price.line(3)
    assert line is not None
    x = line.mean_width  # the weighted mean (newer steps weigh more): near 7
    assert 7.0 < x < 8.0
    assert line.prices(np.array([x]), table_at)[0] == pytest.approx(0.020 + 0.002 * x)  # measured exactly
    slope = (0.002 * line.var + 1.0 * 0.001) / (line.var + 1.0)  # the ridge toward the table's 0.001 a width
    assert slope > 0.0019
    assert line.prices(np.array([12.0]), table_at)[0] == pytest.approx(0.020 + 0.002 * x + (12 - x) * slope)


def test_steps_at_one_mean_width_shift_the_table_by_what_they_measured() -> None:
    price = learnt([(4.0, 0.020)] * MIN_STEPS)  # the table says 0.014 at width 4: ragged steps cost 6 ms more
    prices = price.line(3).prices(np.array([2.0, 4.0, 8.0, 16.0]), table_at)
    np.testing.assert_allclose(prices, ROW[1:] + 0.006)


def test_more_rows_never_cost_less() -> None:
    """Noise that reads a falling line: the slope is held at zero, never negative."""
    price = learnt([(2.0, 0.030), (4.0, 0.020), (2.0, 0.030), (4.0, 0.020), (2.0, 0.030), (4.0, 0.020)])
    prices = price.line(3).prices(np.array([2.0, 3.0, 8.0]), lambda m: np.zeros_like(m))
    assert prices[0] == prices[1] == prices[2] == price.line(3).seconds
    assert 0.020 < prices[0] < 0.030


def test_too_few_steps_or_another_bucket_leave_the_interpolation() -> None:
    price = learnt([(4.0, 0.020)] * (MIN_STEPS - 1))
    assert price.line(3) is None and price.line(2) is None


def test_newer_steps_weigh_more() -> None:
    price = learnt([(4.0, 0.040)] * 20 + [(4.0, 0.020)] * 20, ema=0.1)
    assert 0.020 < price.line(3).seconds < 0.020 + 0.020 * 0.9 ** 20 * 1.01


def test_the_learner_reaches_decisions_only_through_the_broadcast_and_every_rank_loads_the_same() -> None:
    seed = np.array([ROW] * len(BUCKETS))
    rank0, other = CostModel(BUCKETS, BLOCKS, seed, seed_measured=True), CostModel(BUCKETS, BLOCKS, seed)
    for _ in range(MIN_STEPS):
        rank0.observe_ragged(8, rows=40, seconds=0.030)  # mean width 5
    assert rank0.ragged_line(8) is None
    table = rank0.export()
    rank0.load(table)
    other.load(table)
    assert rank0.ragged_line(8) == other.ragged_line(8)
    assert rank0.ragged_line(8).mean_width == 5.0 and rank0.ragged_line(8).seconds == pytest.approx(0.030)
    assert rank0.ragged_line(5) == rank0.ragged_line(8)  # one bucket
    assert rank0.ragged_line(4) is None and rank0.ragged_line(64) is None  # beyond the last bucket: not recorded
    rank0.observe(8, 4, 0.020)  # a cost measurement: the ragged line ages
    assert rank0.export()["ragged"][rank0.bucket_index(8)][-1] == 1


def test_a_table_from_before_ragged_prices_loads_and_a_bad_entry_is_refused() -> None:
    cost = CostModel(BUCKETS, BLOCKS, np.array([ROW] * len(BUCKETS)), seed_measured=True)
    table = cost.export()
    del table["ragged"]
    cost.load(table)
    with pytest.raises(ValueError, match="ragged"):
        cost.load(cost.export() | {"ragged": [None] * 3})
    bad = cost.export()
    bad["ragged"][0] = [4.0, 1.0, 4.0, float("nan"), 16.0, 4.0, 4.0, 0.0]
    with pytest.raises(ValueError, match="ragged"):
        cost.load(bad)


def curve(p: float) -> np.ndarray:
    return np.array([sum(p ** j for j in range(b)) for b in BLOCKS])


def test_the_learnt_line_prices_a_ragged_step_within_its_measured_range() -> None:
    line = learnt([(6.0, 0.030)] * MIN_STEPS).line(3)  # 0.016 by the table at width 6
    both = (line, TABLE[0], ROW)
    measured = (np.array([8, 16]), np.array([0.018, 0.026]))
    assert ragged_cost(measured, 0.010, np.array([4, 8]), both) == pytest.approx(0.030)
    assert ragged_cost(measured, 0.010, np.array([4, 8])) == 0.018  # without it: width 8's, from above
    assert ragged_cost(measured, 0.031, np.array([4, 8]), both) == 0.031  # never below width 1's
    narrow = (np.array([2, 4]), np.array([0.012, 0.014]))
    assert ragged_cost(narrow, 0.010, np.array([8, 8]), both) == float("inf")  # past every measurement
    assert np.isfinite(ragged_cost(narrow, 0.010, np.array([4, 8]), both))  # a ragged step ran at mean 6
    # nothing batch-wide measured, ragged steps were: they alone price
    E = np.stack([curve(0.95), curve(0.05)])
    picks, g = assign(E, np.asarray(BLOCKS), (np.array([], dtype=int), np.array([])), 0.010, 0.0, both)
    assert g > 0.0 and BLOCKS[picks[1]] == 1


@pytest.mark.parametrize(("seconds", "ragged"), [(0.080, False), (0.016, True)])
def test_ragged_steps_measured_dear_stop_and_measured_cheap_go_on(seconds: float, ragged: bool) -> None:
    ctrl = mixed_controller(per_request_widths=True)
    ids = ["a", "b", "c", "d"]
    d = ctrl.decide(ids, ragged=True)
    assert d.widths is not None  # priced by the interpolation, ragged pays
    for _ in range(MIN_STEPS):
        ctrl.observe_ragged_time(len(ids), d.widths, seconds)
    ctrl.sync_cost_table()
    assert (ctrl.decide(ids, ragged=True).widths is not None) is ragged
    stale = ctrl.cfg.explore_stale_measurements + 1
    for _ in range(stale):  # batch-wide measurements elsewhere: the ragged line grows stale, the interpolation
        ctrl.cost_model.observe(32, 1, 0.010)  # prices again
    ctrl.sync_cost_table()
    assert ctrl.decide(ids, ragged=True).widths is not None


def test_only_rank_0_measures_ragged_steps() -> None:
    ctrl = BlockSizeController(ControllerConfig(per_request_widths=True),
                               CostModel(BUCKETS, BLOCKS, np.array([ROW] * len(BUCKETS))), is_rank0=False)
    with pytest.raises(RuntimeError, match="rank 0"):
        ctrl.observe_ragged_time(4, (1, 16), 0.02)
