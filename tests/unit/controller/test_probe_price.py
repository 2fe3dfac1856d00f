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
