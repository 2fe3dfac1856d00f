"""The decision rule: which candidate width a step runs, by mode, with hysteresis and dwell.

Why: the best width shrinks as load grows (verify turns compute-bound) and depends on what the requests are, so
``adaptive`` follows the predicted goodput; ``fixed`` and ``schedule`` exist for operators who want control,
``cycle`` to exercise every width switch in tests.

Contract: ``choose(bs, good, trees, step, exploration, tokens, fresh_trees)`` -> Choice, per mode:
  * ``fixed``: ``fixed_block``; ``schedule``: the entry with the largest batch-size key <= bs (below the smallest
    key, the smallest key's); ``cycle``: ``cycle_pattern`` (or the candidates) in order, one per decision.
  * ``adaptive``: the argmax of ``good`` (estimate.py), but switching away from the current width c only if the
    best beats it by more than ``hysteresis`` and c has been used for ``min_dwell_steps`` decisions (waived when
    the batch-size bucket changes: a new load level is a new situation, not noise), so noise does not make it flap.
    Where it may switch but keeps c, exploration (exploration.py) may pick a width to try instead.
  * ``trees`` False (the batch cannot verify a tree): a tree width becomes the widest chain width.
``idle_block()`` is the width reported for an empty batch; it changes no state.
Invariants: depends only on its inputs and the call sequence (identical on every TP rank).
"""
from __future__ import annotations

import bisect
from typing import NamedTuple

import numpy as np

from .candidates import Candidates
from .config import ControllerConfig
from .cost_model import CostModel
from .exploration import Exploration


class Choice(NamedTuple):
    """A decision's width: candidate ``k``, the previous decision's (None before the first), whether it switched
    and whether exploration picked it."""

    k: int
    previous: int | None
    switched: bool
    explored: bool


class WidthRule:
    """Mode, hysteresis and dwell (module contract); ``cur``/``dwell``/``switches`` are its readouts."""

    def __init__(self, cfg: ControllerConfig, cost: CostModel, cands: Candidates) -> None:
        self.cfg = cfg
        self.cost_model = cost
        self.cands = cands
        sched = cfg.schedule_map()
        self._sched_keys = sorted(sched)
        self._sched_vals = [sched[k] for k in self._sched_keys]
        self.cur: int | None = None  # index into the candidates
        self.dwell = 0
        self.switches = 0
        self._last_bucket: int | None = None

    def _scheduled_block(self, bs: int) -> int:
        i = bisect.bisect_right(self._sched_keys, bs) - 1
        return self._sched_vals[max(i, 0)]

    def idle_block(self) -> int:
        """The mode's width for an empty batch (no state change)."""
        if self.cfg.mode == "fixed":
            return int(self.cfg.fixed_block)  # type: ignore[arg-type]
        if self.cfg.mode == "schedule":
            return int(self._scheduled_block(0))
        return int(self.cands.array[self.cur] if self.cur is not None else self.cands.array[0])

    def choose(self, bs: int, good: np.ndarray, trees: bool, step: int, exploration: Exploration,
               tokens: np.ndarray | None = None, fresh_trees: np.ndarray | None = None) -> Choice:
        """This decision's width for a batch of ``bs`` requests with predicted goodput ``good`` per candidate;
        ``step``: decisions so far."""
        cfg, cands = self.cfg, self.cands
        cur = self.cur
        explored = False
        if cfg.mode == "fixed":
            k = cands.index[cfg.fixed_block]  # type: ignore[index]
        elif cfg.mode == "schedule":
            k = cands.index[self._scheduled_block(bs)]
        elif cfg.mode == "cycle":
            pattern = cfg.cycle_pattern
            k = cands.index[pattern[step % len(pattern)]] if pattern else step % len(cands.widths)
        else:
            best = int(good.argmax())
            bucket = self.cost_model.bucket_index(bs)
            may_switch = self.dwell >= cfg.min_dwell_steps or bucket != self._last_bucket
            if cur is None:
                k = best
            elif best != cur and may_switch and good[best] > good[cur] * (1.0 + cfg.hysteresis):
                k = best
            else:
                k = cur
                if may_switch and cfg.explore_margin > 0.0:
                    k = exploration.pick(bs, bucket, good, cur, step, tokens, fresh_trees)
                    explored = k != cur
            self._last_bucket = bucket
        if not trees and cands.array[k] > cands.max_block:
            k = cands.widest_chain
        switched = cur is not None and k != cur
        if switched:
            self.switches += 1
        self.dwell = 1 if (cur is None or switched) else self.dwell + 1
        self.cur = k
        return Choice(k, cur, switched, explored)

    def hold(self) -> None:
        """A decision that kept the current width without asking (policy.py, a held plain decision): what
        ``choose`` changes when it keeps it."""
        self.dwell += 1
