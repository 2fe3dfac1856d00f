"""AcceptanceStats: E_r(b) invariants, censoring semantics, shrinkage, convergence to the true p_j."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_ext.controller import AcceptanceStats

BLOCKS = np.arange(1, 17)


def _explicit_E(p: np.ndarray, b: int) -> float:
    total = 1.0
    for j in range(1, b):
        prod = 1.0
        for i in range(j):
            prod *= p[i]
        total += prod
    return total


@settings(max_examples=60, deadline=None)
@given(
    obs=st.lists(
        st.tuples(st.integers(1, 7), st.integers(0, 15), st.integers(0, 15)), min_size=0, max_size=60
    ),
    steps=st.lists(st.integers(1, 7), max_size=20),
    k=st.sampled_from([0.0, 1.0, 8.0]),
)
def test_expected_tokens_monotone_and_bounded(obs: list, steps: list, k: float) -> None:
    s = AcceptanceStats(16, prior_strength=k, capacity=8)
    if obs:
        slots = np.array([o[0] for o in obs])
        s.observe(slots, np.array([o[1] for o in obs]), np.array([o[2] for o in obs]))
    for sl in steps:
        s.step(np.array([sl]))
    E = s.expected_tokens(np.arange(8), BLOCKS)
    assert np.all(E >= 1.0 - 1e-12)
    assert np.all(E <= BLOCKS[None, :] + 1e-9)
    assert np.all(np.diff(E, axis=1) >= -1e-12)
    assert np.allclose(E[:, 0], 1.0)
    p = s.request_p(np.arange(8))
    assert np.all((p >= 0.0) & (p <= 1.0))
    # batch sum and block-major forms agree with the per-request form and with the explicit formula
    sl = np.arange(1, 8)
    assert np.allclose(s.batch_expected_tokens(sl, BLOCKS), E[1:].sum(axis=0))
    assert np.allclose(s.expected_tokens_t(sl, BLOCKS).T, E[1:])
    for b in (1, 2, 5, 16):
        assert abs(E[3, b - 1] - _explicit_E(p[3], b)) < 1e-9


def test_censored_observation_semantics() -> None:
    s = AcceptanceStats(8, global_decay=1.0, decay=1.0, capacity=4)
    # width 4 verify (tried 3), accepted 1: pos1 accepted, pos2 rejected, pos3.. unobserved
    s.observe(np.array([1]), np.array([1]), np.array([3]))
    assert s.a_r[:, 1].tolist() == [1, 0, 0, 0, 0, 0, 0]
    assert s.n_r[:, 1].tolist() == [1, 1, 0, 0, 0, 0, 0]
    # all 3 accepted: nothing rejected, positions beyond 3 unobserved
    s.observe(np.array([2]), np.array([3]), np.array([3]))
    assert s.a_r[:, 2].tolist() == [1, 1, 1, 0, 0, 0, 0]
    assert s.n_r[:, 2].tolist() == [1, 1, 1, 0, 0, 0, 0]
    # hindsight (tried J=7): first mismatch at 5 -> positions 1..4 accepted, 5 rejected
    s.observe(np.array([3]), np.array([4]), np.array([7]))
    assert s.n_r[:, 3].tolist() == [1, 1, 1, 1, 1, 0, 0]
    assert np.allclose(s.a_g, s.a_r.sum(axis=1))
    assert np.allclose(s.n_g, s.n_r.sum(axis=1))
    # repeated slot in one call accumulates
    s.observe(np.array([1, 1]), np.array([0, 2]), np.array([3, 3]))
    assert s.n_r[:, 1].tolist()[:3] == [3, 2, 1]


def test_shrinkage_and_chained_global_prior() -> None:
    s = AcceptanceStats(16, prior_strength=8.0, global_prior_mean=0.5, global_prior_strength=2.0, capacity=4)
    pg = s.global_p()
    assert np.allclose(pg, 0.5)  # no data: the prior everywhere
    # global data only at position 1..3 (all accepted, pos 4 rejected) many times
    n = 200
    s.observe_global_only(np.full(n, 3), np.full(n, 15))
    pg = s.global_p()
    assert pg[0] > 0.98 and pg[3] < 0.02
    assert np.allclose(pg[4:], pg[3])  # unobserved positions inherit their neighbour's estimate
    # a request with no data equals the global; with lots of data, its own rate
    assert np.allclose(s.request_p(np.array([0]))[0], pg)
    s.observe(np.full(400, 2), np.zeros(400, dtype=int), np.full(400, 15))
    assert s.request_p(np.array([2]))[0, 0] < 0.05


def test_step_decay_relaxes_toward_prior_without_moving_the_ratio() -> None:
    s = AcceptanceStats(4, decay=0.5, global_decay=0.5, prior_strength=1.0, capacity=4)
    s.observe(np.full(10, 1), np.full(10, 3), np.full(10, 3))
    before = s.request_p(np.array([1]))[0, 0]
    for _ in range(10):
        s.step(np.array([1]))
    after = s.request_p(np.array([1]))[0, 0]
    assert after < before  # evidence faded: back toward the (global -> prior) estimate
    assert np.allclose(s.a_r[:, 1] / s.n_r[:, 1], 1.0)


def test_a_class_keeps_its_global_estimate_through_steps_that_observe_nothing() -> None:
    """The global estimate is a new request's prior: a stretch at width 1 (steps, no observations) must not fade the
    evidence that drafts are never accepted back to the flat prior; the next observed step decays it once."""
    s = AcceptanceStats(4, decay=0.5, global_decay=0.5, capacity=4)
    s.observe(np.full(20, 1), np.zeros(20, dtype=int), np.full(20, 3))  # twenty drafts, none accepted
    fresh = np.array([2])  # a slot with no counts of its own reads the global estimate
    before = s.request_p(fresh)[0, 0]
    assert before < 0.1
    for _ in range(200):
        s.step(np.array([1]))
    assert s.request_p(fresh)[0, 0] == pytest.approx(before)
    s.observe(np.array([1]), np.array([3]), np.array([3]))  # an observed step: old counts halve, then it is added
    assert s.n_g[0] == pytest.approx(20 * 0.5 + 1) and s.a_g[0] == pytest.approx(1.0)


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_estimates_converge_to_true_p(seed: int) -> None:
    rng = np.random.default_rng(seed)
    J = 15
    true_p = np.clip(0.95 - 0.03 * np.arange(J) + rng.uniform(-0.05, 0.05, J), 0.05, 0.99)
    s = AcceptanceStats(16, decay=1.0, global_decay=1.0, capacity=4)
    n = 20000
    ok = rng.random((n, J)) < true_p
    runs = np.where(ok.all(axis=1), J, np.argmin(ok, axis=1))
    s.observe(np.ones(n, dtype=np.intp), runs, np.full(n, J))  # hindsight observations
    est = s.global_p()
    tried = s.n_g
    for j in range(J):
        if tried[j] > 400:
            tol = 4.0 * np.sqrt(true_p[j] * (1 - true_p[j]) / tried[j]) + 0.01
            assert abs(est[j] - true_p[j]) < tol, (j, est[j], true_p[j])
    # per-request estimate with plenty of data tracks the truth too
    assert abs(s.request_p(np.array([1]))[0, 0] - true_p[0]) < 0.02
    # and E(16) matches the empirical mean of 1 + min(R, 15)
    assert abs(s.expected_tokens(np.array([1]), np.array([16]))[0, 0] - (1 + runs.mean())) < 0.15


def test_censored_width_observations_are_unbiased_for_observed_positions() -> None:
    rng = np.random.default_rng(0)
    true_p = np.array([0.9, 0.8, 0.7] + [0.6] * 12)
    s = AcceptanceStats(16, decay=1.0, global_decay=1.0, capacity=4)
    n = 20000
    ok = rng.random((n, 15)) < true_p
    runs = np.where(ok.all(axis=1), 15, np.argmin(ok, axis=1))
    s.observe(np.ones(n, dtype=np.intp), np.minimum(runs, 3), np.full(n, 3))  # width-4 verify
    est = s.global_p()
    assert np.allclose(est[:3], true_p[:3], atol=0.02)
    assert s.n_g[3:].sum() == 0  # positions >= 4 never observed at width 4
