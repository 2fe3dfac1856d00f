"""ProbePrice: a probe's extra time per batch bucket, learned on rank 0, read only once broadcast."""
from __future__ import annotations

import numpy as np
import pytest

from sglang_ext.controller import CostModel
from sglang_ext.controller.probe_price import ProbePrice

BUCKETS = (1, 2, 4, 8, 16, 32)


def test_the_price_is_what_a_probe_adds_to_its_widths_step_and_reaches_decisions_only_through_the_broadcast() -> None:
    cost = CostModel(BUCKETS, (1, 4, 16), np.array([[0.010, 0.02, 0.05]] * len(BUCKETS)), seed_measured=True)
    assert cost.probe_seconds(8) is None
    cost.observe_probe(8, 1, 0.035)  # a width-1 step (10 ms) that drafted the full block
    assert cost.probe_seconds(8) is None  # the learner moved, the active table did not
    other_rank = CostModel(BUCKETS, (1, 4, 16), np.array([[0.010, 0.02, 0.05]] * len(BUCKETS)), seed_measured=True)
    table = cost.export()
    cost.load(table)
    other_rank.load(table)
    assert cost.probe_seconds(8) == pytest.approx(0.025) == other_rank.probe_seconds(8)
    # an unmeasured bucket: the nearest measured one's price scaled by batch size (every row drafts)
    assert cost.probe_seconds(32) == pytest.approx(0.025 * 32 / 8)
    assert cost.probe_seconds(2) == pytest.approx(0.025 * 2 / 8)


def test_a_probes_price_counts_the_colder_steps_after_it_which_still_teach_their_width() -> None:
    seed = np.array([[0.010, 0.02, 0.05]] * len(BUCKETS))

    def priced(after: list[float]) -> tuple[float, float]:
        cost = CostModel(BUCKETS, (1, 4, 16), seed, seed_measured=True)
        cost.observe_probe(8, 1, 0.035)  # 25 ms over width 1's 10 ms
        for seconds in after:
            cost.observe(8, 1, seconds)
        cost.load(cost.export())
        return cost.probe_seconds(8), float(cost.row(8)[0])

    # the two steps after it 3 and 1 ms over width 1's price are the probe's; the one at its price ends them
    price, width1 = priced([0.013, 0.011, 0.010, 0.014])
    assert price == pytest.approx(0.025 + 0.003 + 0.001)
    assert width1 > 0.010  # the colder steps stay in width 1's cell (and the one after the aftermath)
    # at most PROBE_AFTERMATH_STEPS of them
    from sglang_ext.controller.cost_model import PROBE_AFTERMATH_STEPS
    assert priced([0.012] * 10)[0] == pytest.approx(0.025 + 0.002 * PROBE_AFTERMATH_STEPS)
    # another width's step, or another batch bucket's, ends the aftermath
    cost = CostModel(BUCKETS, (1, 4, 16), seed, seed_measured=True)
    cost.observe_probe(8, 1, 0.035)
    cost.observe(8, 4, 0.03)
    cost.observe(8, 1, 0.015)
    cost.load(cost.export())
    assert cost.probe_seconds(8) == pytest.approx(0.025)


def test_a_probe_faster_than_its_widths_price_costs_nothing_and_the_ema_follows_new_prices() -> None:
    price = ProbePrice(BUCKETS, ema=0.5)
    price.observe(0, -0.002)  # timing noise below the table's price
    price.load(price.export())
    assert price.seconds(1, 0) == 0.0
    price.observe(0, 0.004)
    price.load(price.export())
    assert price.seconds(1, 0) == pytest.approx(0.002)


def test_a_table_from_before_probe_prices_loads_and_a_bad_price_is_refused() -> None:
    cost = CostModel(BUCKETS, (1, 16), np.array([[0.01, 0.05]] * len(BUCKETS)), seed_measured=True)
    table = cost.export()
    del table["probe_extra"]
    cost.load(table)
    assert cost.probe_seconds(4) is None
    table["probe_extra"] = [None] * (len(BUCKETS) - 1) + [-1.0]
    with pytest.raises(ValueError, match="probe_extra"):
        cost.load(table)
    table["probe_extra"] = [None] * 2
    with pytest.raises(ValueError, match="probe_extra: 2 values for 6 batch buckets"):
        cost.load(table)
