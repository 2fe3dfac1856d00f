"""CostModel: monotone completion, EMA learning, two-table (learner/active) contract, export/load."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from sglang_ext.controller import CostModel
from sglang_ext.controller.cost_model import DEFAULT_BUCKETS
from sglang_ext.controller.table_fit import isotonic, monotone_table

BLOCKS = (1, 2, 4, 8, 16)
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def _is_monotone(t: np.ndarray) -> bool:
    return bool(np.all(np.diff(t, axis=0) >= -1e-15) and np.all(np.diff(t, axis=1) >= -1e-15))


@settings(max_examples=80, deadline=None)
@given(
    cells=hnp.arrays(
        np.float64,
        (len(BUCKETS), len(BLOCKS)),
        elements=st.one_of(st.just(np.nan), st.floats(1e-4, 1.0)),
    ).filter(lambda a: np.isfinite(a).any()),
    weights=hnp.arrays(np.float64, (len(BUCKETS), len(BLOCKS)), elements=st.floats(0.1, 100.0)),
)
def test_completion_is_total_positive_and_monotone(cells: np.ndarray, weights: np.ndarray) -> None:
    t = monotone_table(cells, BUCKETS, BLOCKS, weights)
    assert t.shape == cells.shape
    assert np.isfinite(t).all() and (t > 0).all()
    assert _is_monotone(t)


def _fit_every_row_and_column(cells: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """monotone_table's steps with every row and column fitted, monotone or not (the reference)."""
    from sglang_ext.controller.table_fit import _interp_fill, spread_pooled

    t = np.array(cells, dtype=float)
    known = np.isfinite(t)
    w = np.where(known, np.maximum(weights, 1e-6), 0.05)
    bx, kx = np.asarray(BUCKETS, dtype=float), np.asarray(BLOCKS, dtype=float)
    for k in range(t.shape[1]):
        t[:, k] = _interp_fill(t[:, k], bx)
    for i in range(t.shape[0]):
        t[i, :] = _interp_fill(t[i, :], kx)
    t = np.maximum(t, max(1e-9, float(np.nanmin(t[t > 0])) * 1e-3))
    for i in range(t.shape[0]):
        t[i, :] = spread_pooled(isotonic(t[i, :], w[i, :]), kx, w[i, :], t[i, :])
    for k in range(t.shape[1]):
        t[:, k] = isotonic(t[:, k], w[:, k])
    return np.maximum.accumulate(np.maximum.accumulate(t, axis=1), axis=0)


@settings(max_examples=80, deadline=None)
@given(
    base=st.floats(1e-3, 0.1),
    noise=hnp.arrays(np.float64, (len(BUCKETS), len(BLOCKS)), elements=st.floats(-0.3, 0.3)),
    holes=hnp.arrays(np.bool_, (len(BUCKETS), len(BLOCKS))),
    weights=hnp.arrays(np.float64, (len(BUCKETS), len(BLOCKS)), elements=st.floats(0.1, 100.0)),
)
def test_a_table_fits_as_if_every_row_and_column_were_fitted(base, noise, holes, weights) -> None:
    """Rows and columns already non-decreasing are not refitted (the table is resolved at every cost sync): the
    result is the fit of every row and column, on tables that are monotone, nearly so, or not at all."""
    grid = base * (1.0 + np.add.outer(np.arange(len(BUCKETS)), np.arange(len(BLOCKS))) / 4.0)
    cells = np.where(holes & (np.arange(grid.size).reshape(grid.shape) > 0), np.nan, grid * (1.0 + noise))
    assert np.array_equal(monotone_table(cells, BUCKETS, BLOCKS, weights), _fit_every_row_and_column(cells, weights))


def test_monotone_input_is_kept_and_holes_interpolated() -> None:
    base = np.array([[1.0 + 0.1 * i + 0.01 * k for k in range(5)] for i in range(7)])
    assert np.allclose(monotone_table(base, BUCKETS, BLOCKS), base)
    holes = base.copy()
    holes[3, 2] = np.nan  # interior along both axes: linear in batch between buckets 4 and 16
    holes[6, :] = np.nan  # last bucket: extrapolated
    t = monotone_table(holes, BUCKETS, BLOCKS)
    assert _is_monotone(t)
    assert base[2, 2] <= t[3, 2] <= base[4, 2]
    assert np.all(t[6] >= t[5])


@given(y=hnp.arrays(np.float64, st.integers(1, 12), elements=st.floats(-10, 10)))
def test_isotonic_is_monotone_and_preserves_weighted_mean(y: np.ndarray) -> None:
    w = np.linspace(1.0, 2.0, y.size)
    f = isotonic(y, w)
    assert np.all(np.diff(f) >= -1e-9)
    assert abs((f * w).sum() - (y * w).sum()) < 1e-6 * max(1.0, abs(y).sum())


def test_one_noisy_cell_does_not_raise_the_whole_row() -> None:
    seed = np.array([[5.0, 6.0, 6.0, 6.1, 6.5]])
    seed[0, 1] = 6.6  # noisy: above b=4, 8 and 16
    t = monotone_table(seed, (8,), BLOCKS, np.array([[1, 1, 1, 1, 50.0]]))
    assert t[0, 3] < 6.5  # a running max would have made b=8 cost 6.6


def test_a_sparsely_measured_wider_cell_pooled_with_a_narrower_one_is_not_priced_as_free() -> None:
    """Width 4 measured a few times below width 2 (noise, or a shorter context then): pooling alone priced it at
    width 2's cost, so it looked free; the well-measured width 2 keeps its price and width 4 lies between it and
    width 8."""
    row = np.array([[0.046, 0.062, 0.058, 0.107, 0.171]])
    t = monotone_table(row, (32,), BLOCKS, np.array([[900.0, 60.0, 3.0, 30.0, 10.0]]))
    assert t[0, 1] == pytest.approx(0.0618, abs=5e-4)  # width 2: about its own measurement
    assert 0.070 < t[0, 2] < 0.080  # width 4: on the line from width 2 to width 8
    assert t[0, 0] == pytest.approx(0.046) and t[0, 3] == pytest.approx(0.107)


def test_learner_converges_and_active_changes_only_on_load() -> None:
    m = CostModel(BUCKETS, BLOCKS, np.full((7, 5), 0.01), ema=0.1)
    before = m.table
    for _ in range(200):
        m.observe(8, 4, 0.02)
    assert np.array_equal(m.table, before)  # decisions unaffected until load
    assert m.version == 0
    t = m.export()
    assert t["version"] == 1
    json.dumps(t)  # plain JSON-able
    m.load(t)
    assert m.version == 1
    assert abs(m.row(8)[2] - 0.02) < 1e-3
    # unmeasured cells of the same bucket are shifted by the bucket's mean residual (+0.01)
    assert abs(m.row(8)[3] - 0.02) < 1e-3
    # monotone across batch: bucket 16 not below bucket 8
    assert np.all(m.row(16) >= m.row(8))


def test_first_measurement_dominates_an_unseeded_cell_and_seed_weight_blends() -> None:
    seed = np.full((7, 5), np.nan)
    seed[:, 0] = 0.005
    m = CostModel(BUCKETS, BLOCKS, seed)
    m.observe(4, 8, 0.03)
    t = m.resolve()
    assert abs(t[2, 3] - 0.03) < 1e-12
    m.observe(4, 1, 0.011)  # seeded cell: blend with seed weight 2 -> 0.005 + (0.006)/3
    t = m.resolve()
    assert abs(t[2, 0] - 0.007) < 1e-9
    # the residual (+0.002) shifts the unmeasured seeds of the other buckets too (flat beyond measured ones)
    assert np.allclose(t[:, 0], 0.007)


def test_rows_and_buckets() -> None:
    m = CostModel(BUCKETS, BLOCKS, np.array([[0.001 * (i + 1) * (k + 1) for k in range(5)] for i in range(7)]))
    assert np.array_equal(m.row(3), m.row(4))  # pads up to the next bucket
    far = m.row(128)
    assert np.all(far >= m.row(64)) and np.all(np.diff(far) >= 0)
    assert m.bucket_index(65) == len(BUCKETS)
    m.observe(1000, 1, 0.5)
    assert m.dropped_measurements == 1


def test_load_validation_names_the_field() -> None:
    m = CostModel.default(BLOCKS)
    good = m.export()
    with pytest.raises(ValueError, match=r"^block_sizes:"):
        m.load({**good, "block_sizes": [1, 2]})
    with pytest.raises(ValueError, match=r"^batch_buckets:"):
        m.load({**good, "batch_buckets": [1]})
    bad = [row[:] for row in good["seconds"]]
    bad[0][0] = -1.0
    with pytest.raises(ValueError, match=r"^seconds:"):
        m.load({**good, "seconds": bad})
    with pytest.raises(ValueError, match=r"^version:"):
        m.load({**good, "version": "x"})
    with pytest.raises(ValueError, match=r"^block_size:"):
        m.observe(8, 3, 0.01)
    with pytest.raises(ValueError, match=r"^seconds:"):
        m.observe(8, 4, float("nan"))


def test_from_profile_measured_table_and_roofline() -> None:
    table = {"batch_buckets": [1, 8, 64], "block_sizes": [1, 4, 16], "seconds": [[1, 2, 3], [2, 3, 4], [5, 6, 9]]}
    m = CostModel.from_profile(table, BLOCKS)
    assert m.batch_buckets == (1, 8, 64) and m.block_sizes == BLOCKS
    assert _is_monotone(m.table) and m.table[0, 0] == 1 and m.table[2, 4] == 9
    assert m.table[0, 0] <= m.table[0, 1] <= m.table[0, 2]  # b=2 interpolated between 1 and 4
    r = CostModel.from_profile(table, BLOCKS, batch_buckets=(1, 4, 64))
    assert r.batch_buckets == (1, 4, 64)
    d = CostModel.default(BLOCKS)
    assert d.batch_buckets == DEFAULT_BUCKETS and _is_monotone(d.table)
    with pytest.raises(ValueError, match=r"^seconds:"):
        CostModel.from_profile({**table, "seconds": [[1]]}, BLOCKS)
    with pytest.raises(ValueError, match=r"^hardware"):
        CostModel.from_profile({"target": {}}, BLOCKS)


def test_evidence_travels_with_the_table() -> None:
    a = CostModel.default(BLOCKS)
    b = CostModel.default(BLOCKS)
    for _ in range(5):
        a.observe(8, 4, 0.01)
    a.observe(8, 2, 0.01)
    b.load(json.loads(json.dumps(a.export())))
    counts, age = b.active_evidence(8)
    assert counts.tolist() == [0, 1, 5, 0, 0]
    assert age[1] == 0 and age[2] == 1 and age[0] > 10**12


def test_unmeasured_widths_follow_the_measured_ones_slope_across_widths() -> None:
    """A seed modelled for other hardware (flat in b, as the H200 roofline is at low batch) against a machine whose
    step grows with b: two measured widths at a bucket price the unmeasured ones on their line, not at their mean
    (which made chain 16 read 51 ms where it costs 33, so the controller never went back to it)."""
    blocks = (1, 16, 32, 64)
    m = CostModel(BUCKETS, blocks, np.full((len(BUCKETS), 4), 0.010), ema=0.1)
    for _ in range(100):
        m.observe(8, 32, 0.045)
        m.observe(8, 64, 0.070)
    t = m.resolve()
    i = m.bucket_index(8)
    assert t[i, 2] == pytest.approx(0.045, abs=1e-4) and t[i, 3] == pytest.approx(0.070, abs=1e-4)
    assert t[i, 1] == pytest.approx(0.0325, abs=5e-4)  # on the line through (32, +35 ms) and (64, +60 ms)
    assert t[i, 0] == pytest.approx(0.010 + 0.035 - 31 * 0.025 / 32, abs=5e-4)
    # a bucket with one measured width takes its own level and the slope of its neighbour, scaled by the batch
    # below the smallest bucket with a slope (a width adds one token per request): 2 / 8 of bucket 8's here
    for _ in range(100):
        m.observe(2, 64, 0.040)
    t = m.resolve()
    assert t[m.bucket_index(2), 2] == pytest.approx(0.040 - 32 * (0.025 / 32) * (2 / 8), abs=5e-4)


def test_one_measured_wide_width_at_one_request_prices_no_width_as_free() -> None:
    """Seen in a CPU server (prose, 4 users, the default H200 roofline seed): bucket 4 measured at every width
    (12 -> 30 ms, ~1.2 ms a width), bucket 1 only at width 16 (16 ms). Bucket 4's slope held flat down to bucket
    1 put its widths 1 and 2 below zero, floored to microseconds: goodput of millions of tokens a second, and the
    controller switched to width 2 at one request on a token-count tie."""
    m = CostModel.default(BLOCKS)
    measured = {(4, 1): 0.0119, (4, 2): 0.0176, (4, 4): 0.0226, (4, 8): 0.0209, (4, 16): 0.0298,
                (2, 1): 0.0102, (1, 16): 0.0159}
    for _ in range(30):
        for (bs, b), sec in measured.items():
            m.observe(bs, b, sec)
    t = m.resolve()
    row = t[m.bucket_index(1)]
    assert row[0] > 0.005 and row[1] > 0.005  # a one-request step on this machine costs ~8-10 ms, never ~0
    assert t.min() >= 0.25 * min(measured.values()) - 1e-12
    assert row[-1] == pytest.approx(0.0159, rel=0.05)  # the measured cell keeps its value
