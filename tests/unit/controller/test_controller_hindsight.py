"""Hindsight: agrees with full-width verify on greedy streams, never double counts, resolves across steps."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_ext.controller import BlockSizeController, ControllerConfig, CostModel
from sglang_ext.controller.hindsight import HindsightBuffer

MAXB = 16
J = MAXB - 1


class GreedyStream:
    """A request whose target output is fixed (greedy); drafts match a random-length prefix."""

    def __init__(self, rng: np.random.Generator, length: int = 4000) -> None:
        self.rng = rng
        self.truth = rng.integers(0, 1000, length + 64)
        self.pos = 0

    def draft(self, p: float) -> tuple[np.ndarray, int]:
        r = 0
        while r < J and self.rng.random() < p:
            r += 1
        d = self.truth[self.pos : self.pos + J].copy()
        d[r:] += 1  # guaranteed mismatch from r on
        return d, r

    def commit(self, k: int) -> list[int]:
        out = self.truth[self.pos : self.pos + k + 1].tolist()
        self.pos += k + 1
        return out


def _controller(**kw: object) -> BlockSizeController:
    cfg = ControllerConfig(decay=1.0, global_decay=1.0, **kw)  # type: ignore[arg-type]
    return BlockSizeController(cfg, CostModel.default(cfg.candidates_for(MAXB)), max_block=MAXB)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6), p=st.floats(0.1, 0.97), bs=st.integers(1, 6))
def test_hindsight_equals_full_width_verify_on_greedy(seed: int, p: float, bs: int) -> None:
    """Width-16 verify with the draft (hindsight) and without it (censored verify) give the same counts."""
    rng = np.random.default_rng(seed)
    streams = [GreedyStream(rng) for _ in range(bs)]
    with_h, without = _controller(), _controller()
    ids = list(range(bs))
    for _ in range(60):
        drafts, runs = zip(*(s.draft(p) for s in streams))
        acc = np.array([min(r, J) for r in runs])  # full width: b - 1 = J
        committed = [s.commit(int(k)) for s, k in zip(streams, acc)]
        with_h.observe_step(ids, MAXB, acc, np.stack(drafts), committed)
        without.observe_step(ids, MAXB, acc, None, committed)
    assert np.allclose(with_h.stats.a_g, without.stats.a_g)
    assert np.allclose(with_h.stats.n_g, without.stats.n_g)
    assert np.allclose(with_h.stats.a_r, without.stats.a_r)
    assert np.allclose(with_h.stats.n_r, without.stats.n_r)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6), p=st.floats(0.3, 0.97), b=st.sampled_from([2, 4, 8]))
def test_hindsight_sees_beyond_the_verified_width(seed: int, p: float, b: int) -> None:
    """At width b < 16, hindsight records exactly the run length R of every block (verify only min(R, b-1))."""
    rng = np.random.default_rng(seed)
    s = GreedyStream(rng)
    ctrl = _controller()
    runs = []
    for _ in range(80):
        d, r = s.draft(p)
        runs.append(r)
        k = min(r, b - 1)
        ctrl.observe_step(["a"], b, np.array([k]), d[None, :], [s.commit(k)])
    ctrl.finish("a")  # flush the still-open blocks (censored)
    # reference: every run observed exactly, except the tail blocks flushed as censored (no rejection)
    ref = AcceptanceRef(J)
    hb = HindsightReference(s.truth, J)
    for acc, tried in hb.replay(runs, b):
        ref.add(acc, tried)
    assert np.allclose(ctrl.stats.a_g, ref.a)
    assert np.allclose(ctrl.stats.n_g, ref.n)


class AcceptanceRef:
    def __init__(self, J: int) -> None:
        self.a = np.zeros(J)
        self.n = np.zeros(J)

    def add(self, acc: int, tried: int) -> None:
        for j in range(1, min(acc, tried) + 1):
            self.a[j - 1] += 1
            self.n[j - 1] += 1
        if acc < tried:
            self.n[acc] += 1


class HindsightReference:
    """Slow, obvious re-implementation: block i starts at stream position start_i; decided after J tokens."""

    def __init__(self, truth: np.ndarray, J: int) -> None:
        self.truth = truth
        self.J = J

    def replay(self, runs: list[int], b: int) -> list[tuple[int, int]]:
        starts, pos = [], 0
        for r in runs:
            starts.append(pos)
            pos += min(r, b - 1) + 1
        total = pos
        out = []
        for st_, r in zip(starts, runs):
            seen = total - st_
            if r < self.J and r < seen:
                out.append((r, self.J))  # mismatch seen
            elif seen >= self.J:
                out.append((self.J, self.J))
            else:
                out.append((seen, seen))  # flushed at finish: censored, no rejection
        return out


def test_b1_probe_block_resolves_over_later_steps() -> None:
    """A probe at b=1 drafts 15 tokens; each later b=1 step commits one token; the block resolves at the mismatch."""
    rng = np.random.default_rng(1)
    s = GreedyStream(rng)
    ctrl = _controller()
    d = s.truth[0:J].copy()
    d[5] += 1  # run length 5
    ctrl.observe_step(["r"], 1, np.array([0]), d[None, :], [s.commit(0)])
    assert ctrl.stats.n_g.sum() == 0  # undecided
    for i in range(1, 5):
        ctrl.observe_step(["r"], 1, np.array([0]), None, [s.commit(0)])
        assert ctrl.stats.n_g.sum() == 0
    ctrl.observe_step(["r"], 1, np.array([0]), None, [s.commit(0)])  # 6th token = position 6 mismatch
    assert ctrl.stats.a_g.tolist()[:6] == [1, 1, 1, 1, 1, 0]
    assert ctrl.stats.n_g.tolist()[:7] == [1, 1, 1, 1, 1, 1, 0]


def test_step_without_draft_at_b1_observes_nothing() -> None:
    ctrl = _controller()
    ctrl.observe_step(["r"], 1, np.array([0]), None, [[7]])
    assert ctrl.stats.n_g.sum() == 0 and ctrl.stats.n_r.sum() == 0


def test_no_double_count_one_observation_per_block() -> None:
    rng = np.random.default_rng(2)
    s = GreedyStream(rng)
    ctrl = _controller()
    d, r = s.draft(0.0)  # run length 0: mismatch at position 1
    ctrl.observe_step(["r"], 8, np.array([0]), d[None, :], [s.commit(0)])
    assert ctrl.stats.n_g[0] == 1 and ctrl.stats.a_g[0] == 0 and ctrl.stats.n_g[1:].sum() == 0


def test_buffer_capacity_and_reset() -> None:
    hb = HindsightBuffer(16, capacity=4)
    assert hb.L >= 2 * 16 and hb.L & (hb.L - 1) == 0
    hb.resize(8)
    assert hb.capacity == 8 and hb.pend_valid.shape == (8, J)
    hb.add_blocks(np.array([3]), np.zeros((1, J), dtype=np.int64))
    hb.reset(np.array([3]))
    assert not hb.pend_valid[3].any() and hb.stream_len[3] == 0


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), probe_every=st.integers(1, 40))
def test_skipping_the_stream_while_nothing_is_pending_changes_no_estimate(seed: int, probe_every: int) -> None:
    """Speculation off (width 1) with a probe every few steps: the controller skips hindsight's stream while no
    block is undecided. Its estimates must equal a reference fed every committed token."""
    rng = np.random.default_rng(seed)
    streams = [GreedyStream(rng) for _ in range(3)]
    ctrl = _controller()
    ref = HindsightBuffer(MAXB, 8)
    ref_obs: list[tuple[int, int]] = []
    for step in range(200):
        probe = step % probe_every == 0
        drafted = np.stack([s.draft(0.8)[0] for s in streams]) if probe else None
        committed = [s.commit(0) for s in streams]
        slots = np.arange(1, 4)
        if probe:
            ref.add_blocks(slots, drafted)
        ref.append(slots, np.ones(3, dtype=np.int64), np.array([c[0] for c in committed]))
        rs, ra, _ = ref.resolve(slots)
        ref_obs += list(zip(rs.tolist(), ra.tolist()))
        ctrl.observe_step(["a", "b", "c"], 1, np.zeros(3, dtype=np.int64), drafted, committed)
    ref_stats = _controller().stats
    for slot, acc in ref_obs:
        ref_stats.observe(np.array([slot]), np.array([acc]), np.array([J]))
    np.testing.assert_allclose(ctrl.stats.a_r[:, 1:4], ref_stats.a_r[:, 1:4])
    np.testing.assert_allclose(ctrl.stats.n_r[:, 1:4], ref_stats.n_r[:, 1:4])
