"""WidthCalibration: a width's own accepted drafts over the curve's prediction, shrunk, decayed, bounded."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_ext.controller.calibration import RATIO_MAX, RATIO_MIN, WidthCalibration


def test_no_evidence_is_the_curve_itself() -> None:
    cal = WidthCalibration((2, 4, 8))
    assert cal.ratio().tolist() == [1.0, 1.0, 1.0]
    assert 4 in cal and 16 not in cal


def test_a_width_that_accepts_more_than_predicted_is_scaled_up_only_there() -> None:
    cal = WidthCalibration((4, 8), decay=1.0, prior_strength=8.0)
    for _ in range(200):  # 4 requests a step, each predicted 4.0 drafts, accepting 5
        cal.observe(8, np.full(4, 5.0), np.full(4, 4.0))
    r = cal.ratio()
    assert r[1] == pytest.approx((800 * 5 + 8 * 4) / (800 * 4 + 8 * 4))  # the prior: 8 request-steps at ratio 1
    assert r[0] == 1.0
    assert cal.steps.tolist() == [0, 200] and cal.version == 200


def test_one_step_moves_the_ratio_by_its_weight_against_the_prior() -> None:
    cal = WidthCalibration((8,), prior_strength=8.0)
    cal.observe(8, np.array([7.0]), np.array([3.0]))  # one request-step against 8 of prior
    assert cal.ratio()[0] == pytest.approx((7 + 24) / (3 + 24))


def test_decay_forgets_old_evidence() -> None:
    cal = WidthCalibration((8,), decay=0.9, prior_strength=0.0)
    for _ in range(100):
        cal.observe(8, np.array([2.0]), np.array([4.0]))
    for _ in range(100):
        cal.observe(8, np.array([6.0]), np.array([4.0]))
    assert cal.ratio()[0] == pytest.approx(1.5, rel=1e-3)


@settings(max_examples=50, deadline=None)
@given(acc=st.lists(st.floats(0, 15), min_size=1, max_size=8), pred=st.floats(0, 15))
def test_ratio_stays_within_its_bounds(acc: list[float], pred: float) -> None:
    cal = WidthCalibration((8,), prior_strength=0.0)
    cal.observe(8, np.asarray(acc), np.full(len(acc), pred))
    assert RATIO_MIN <= cal.ratio()[0] <= RATIO_MAX


def test_bad_input_names_the_argument() -> None:
    cal = WidthCalibration((4,))
    with pytest.raises(ValueError, match="width"):
        cal.observe(8, np.zeros(1), np.zeros(1))
    with pytest.raises(ValueError, match="accepted and predicted"):
        cal.observe(4, np.zeros(2), np.zeros(3))
    with pytest.raises(ValueError, match="decay"):
        WidthCalibration((4,), decay=0.0)
    with pytest.raises(ValueError, match="prior_strength"):
        WidthCalibration((4,), prior_strength=-1.0)
    with pytest.raises(ValueError):
        cal.ratio()[0] = 2.0  # read-only: the controller's estimate must not be edited through it
