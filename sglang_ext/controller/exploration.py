"""Exploration: try a width whose step cost at this load was never (or long ago) measured.

Why: an unmeasured cost cell is extrapolated; if the extrapolation overstates it the width is never chosen, hence
never measured (a pessimism trap; docs/ADAPTIVE.md).

Contract: ``pick(bs, bucket, good, cur, step)`` -> the candidate to run instead of ``cur`` for one dwell period,
or ``cur``. A candidate qualifies when its cost cell in this batch bucket has fewer than max(4, min_dwell_steps)
measurements or more than ``explore_stale_measurements`` measurements elsewhere since its last, and its predicted
goodput is within ``explore_margin`` of ``cur``'s; or, when the seed table was modelled rather than profiled on this
machine (``CostModel.active_seed_measured`` False), when its cell was never measured, it predicts at least
NEVER_FLOOR of ``cur``'s goodput, and the width was not measured at a bucket within 2x of this batch size
(``CostModel.active_measured_near``: its cell is then priced from that measurement). Of the qualifying candidates
not tried in this bucket within 4 x max(cost_sync_interval, min_dwell_steps) decisions the best-predicted is picked
-- the narrowest while a never-measured one qualifies: its price is a guess, and the narrowest is the cheapest to
try and its measured cost bounds every wider width's (below). None while the last pick's measurements have yet to
reach the active table (at most a dwell period and two cost syncs), nor a wider one while ``cur``'s own cell in this
bucket is unmeasured (at a new load level every price, ``cur``'s included, is a guess). Never a width that could not
win at the least step cost it can have: a step costs at least what a narrower one does (cost_model.py keeps the
table monotone), so a wider width costs at least ``cur``'s and at least every narrower width priced from a
measurement at this load (this bucket, or one within 2x); if its goodput at that bound is within ``hysteresis`` of
``cur``'s (with that bound ``cur``'s own cost: its expected ``tokens`` within ``hysteresis`` of ``cur``'s), it would
not be switched to whatever its cell measured -- except a tree no tree step has measured (``fresh_trees``: its
tokens are chain B's by the prior) while chain B's tokens beat the narrowest width's: its other branches may add
what no estimate knows yet. ``explorations`` counts the picks.
Invariants: depends only on the broadcast cost table and the decision count (identical on every TP rank).
"""
from __future__ import annotations

import numpy as np

from .candidates import Candidates
from .config import ControllerConfig
from .cost_model import CostModel

# The least fraction of the current width's goodput at which a never-measured cell under a modelled seed is tried.
# Why a floor: below it the extrapolated cost would have to be over 2x too high to hide a better width (unmeasured
# cells are priced on the line of the bucket's measured residuals), while trying a hopeless width costs a dwell
# period of much dearer steps at every new load level.
NEVER_FLOOR = 0.5


class Exploration:
    """Which unmeasured or stale cost cell to try (module contract)."""

    def __init__(self, cfg: ControllerConfig, cost: CostModel, cands: Candidates) -> None:
        self.cfg = cfg
        self.cost_model = cost
        self._cost_idx = cands.cost_idx
        self.explorations = 0
        self.explored: dict[tuple[int, int], int] = {}  # (bucket, candidate) -> decision count when last tried
        self._under_cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._under_version = -1
        self._ok_for: tuple | None = None  # the inputs of the candidates it holds (`good` by identity)
        self._ok = np.zeros(0, dtype=bool)
        # [cur, k]: candidate k verifies more tokens per request than cur (a tree's width counts its nodes)
        widths = np.asarray(cands.array)
        self._wider = widths[None, :] > widths[:, None]
        self._narrow_first = [int(k) for k in np.argsort(widths, kind="stable")]
        # [j, k]: candidate j verifies no more tokens than k and is not k (its measured cost bounds k's from below)
        self._narrower_other = (widths[:, None] <= widths[None, :]) & ~np.eye(len(widths), dtype=bool)
        self._widest_chain, self._narrowest = cands.widest_chain, int(widths.argmin())
        self._pending: tuple[int, int, int, int] | None = None  # (batch size, candidate, its count, decision)
        # the first decision at which the last ``pick`` that kept ``cur`` could answer otherwise, its inputs (the
        # estimate, ``cur``, the bucket, the active table) unchanged: a wait or a cooldown ending
        self.quiet_until: float = 0

    def _unmeasured(self, bs: int, bucket: int) -> tuple[np.ndarray, np.ndarray]:
        """(under-measured or stale cells, never-measured cells to try whatever the margin) of the bucket."""
        version = self.cost_model.version
        if self._under_version != version:
            self._under_cache.clear()
            self._under_version = version
        cached = self._under_cache.get(bucket)
        if cached is None:
            counts, age = self.cost_model.active_evidence(bs)
            counts, age = counts[self._cost_idx], age[self._cost_idx]
            need = max(4, self.cfg.min_dwell_steps)
            under = (counts < need) | (age > self.cfg.explore_stale_measurements)
            never = (counts == 0) & (not self.cost_model.active_seed_measured)
            if never.any():
                never &= ~self.cost_model.active_measured_near(bs)[self._cost_idx]
            cached = (under, never)
            self._under_cache[bucket] = cached
        return cached

    def _cost_ratio_to_bound(self, bs: int, cur: int) -> np.ndarray:
        """Per candidate: its priced step cost over the least it can cost -- the most expensive of ``cur`` and the
        narrower candidates priced from a measurement in this bucket or one within 2x of it (itself excluded: an
        under-measured cell is re-measured for its own sake). Why: under a modelled seed a wide cell is priced by
        extrapolation, often far too cheap; a narrower width measured at this load already bounds it from below. At
        a new load level prose at temperature 1 tried widths 8 and 16 for a dwell period each, at several times
        width 1's cost, after width 2 had been measured too dear to pay for its few more tokens."""
        row = self.cost_model.row(bs)[self._cost_idx]
        priced = (self.cost_model.active_evidence(bs)[0] > 0) | self.cost_model.active_measured_near(bs)
        measured = np.where(priced[self._cost_idx], row, 0.0)
        bound = np.where(self._narrower_other, measured[:, None], 0.0).max(axis=0)
        return row / np.maximum(bound, row[cur])

    def _waiting(self, step: int) -> bool:
        """Whether the last pick's measurements have yet to reach the active table (a sync after its dwell), at most
        a dwell and two syncs. Why: the next pick is bounded by what the last one measured; picked before the table
        holds it, width 8 was tried right after width 2 had been measured too dear to pay."""
        if self._pending is None:
            return False
        bs, k, count, since = self._pending
        if (self.cost_model.active_evidence(bs)[0][self._cost_idx[k]] <= count
                and step - since < self.cfg.min_dwell_steps + 2 * self.cfg.cost_sync_interval):
            self.quiet_until = since + self.cfg.min_dwell_steps + 2 * self.cfg.cost_sync_interval
            return True
        self._pending = None
        return False

    def pick(self, bs: int, bucket: int, good: np.ndarray, cur: int, step: int,
             tokens: np.ndarray | None = None, fresh_trees: np.ndarray | None = None) -> int:
        """The candidate to try instead of ``cur`` at decision ``step``, or ``cur`` (module contract); ``tokens``:
        the batch's expected tokens per step at each candidate (None: no width is ruled out by them);
        ``fresh_trees``: the tree candidates whose gain over chain B no tree step has measured yet."""
        if self._waiting(step):
            return cur
        self.quiet_until = float("inf")
        under, never = self._unmeasured(bs, bucket)
        if not under.any():
            return cur
        version = self.cost_model.version
        if self._ok_for is not None and self._ok_for[0] is good and self._ok_for[1:] == (cur, bucket, version):
            ok = self._ok  # the same (reused) estimate, width, bucket and table: the same candidates
        else:
            near = good >= good[cur] * (1.0 - self.cfg.explore_margin)
            ok = (under & near) | (never & (good >= good[cur] * NEVER_FLOOR))
            ok[cur] = False
            if tokens is not None:  # why: a drafter that guesses nothing makes every wider width a lost dwell period
                lift = 1.0 + self.cfg.hysteresis
                hopeless = self._wider[cur] & ((tokens <= tokens[cur] * lift)
                                               | (good * self._cost_ratio_to_bound(bs, cur)
                                                  <= good[cur] * lift))
                if fresh_trees is not None and tokens[self._widest_chain] > tokens[self._narrowest] * lift:
                    hopeless &= ~fresh_trees  # its tokens are chain B's by the prior: only a tree step measures them
                ok &= ~hopeless
            if self.cost_model.active_evidence(bs)[0][self._cost_idx[cur]] == 0:
                ok &= ~self._wider[cur]  # the bound on a wider width is cur's own cost: a guess until measured here
            self._ok_for, self._ok = (good, cur, bucket, version), ok
        if not ok.any():
            return cur
        cooldown = 4 * max(self.cfg.cost_sync_interval, self.cfg.min_dwell_steps)
        # a cell priced by a modelled guess (``never``) from the cheap end: its prediction says little, and the
        # narrowest measured bounds the wider ones; cells priced near their measurements, best predicted first
        order = self._narrow_first if (ok & never).any() else np.argsort(-good)
        for k in order:
            k = int(k)
            last = self.explored.get((bucket, k), -(10**18))
            if ok[k] and step - last >= cooldown:
                self.explored[(bucket, k)] = step
                self._pending = (bs, k, int(self.cost_model.active_evidence(bs)[0][self._cost_idx[k]]), step)
                self.explorations += 1
                return k
            if ok[k]:
                self.quiet_until = min(self.quiet_until, last + cooldown)
        return cur
