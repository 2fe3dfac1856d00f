"""Per-request widths: the ragged step laid over a batch-wide decision.

Why: with one width per batch, requests the drafter cannot guess verify as wide as the rest (ragged.py).

Contract: ``pick(ragged, E, tokens, k, bs, step, explored)`` -> (widths per request, predicted goodput, mean
expected tokens) or None, only with ``per_request_widths``, when the worker can run a ragged step this step
(``ragged``) and the batch has 2+ requests:
  * ``adaptive``: the best assignment of chain widths when it predicts more than ``hysteresis`` over the
    batch-wide candidate ``k``, scored like it by this step's expected tokens per second, sum_r E_r / T
    (per-request widths are what the steady objective's harmonic weighting stands in for); T from the line of this
    bucket's measured ragged steps (ragged_price.py) while it is fresh (``explore_stale_measurements``), else at
    the mean width from measured cells only (ragged.py); never over a tree or an exploration (which measures a cell
    ragged steps are priced from);
  * ``cycle`` (a test of every mix of widths): request i verifies the pattern's entry i steps ahead of this
    decision's, trees as the widest chain width.
None when every request would get one width. The batch-wide state (current width, dwell, probes) runs on
underneath: the caller runs a probe due this step batch-wide instead. ``steps`` counts the ragged steps taken.
Invariants: deterministic in its inputs (identical on every TP rank).
"""
from __future__ import annotations

import numpy as np

from .candidates import Candidates
from .config import ControllerConfig
from .cost_model import CostModel
from .ragged import assign

Ragged = tuple[tuple[int, ...], float, float]


class RaggedOverlay:
    """Per-request widths for one step (module contract)."""

    def __init__(self, cfg: ControllerConfig, cost: CostModel, cands: Candidates) -> None:
        self.cfg = cfg
        self.cost_model = cost
        self.cands = cands
        self.steps = 0
        self._for: tuple | None = None  # the inputs of the value it holds (E by identity)
        self._value: Ragged | None = None

    def pick(self, ragged: bool, E: np.ndarray, tokens: np.ndarray, k: int, bs: int, step: int,
             explored: bool) -> Ragged | None:
        """This step's per-request widths, or None (module contract)."""
        cfg = self.cfg
        if not (ragged and cfg.per_request_widths and bs > 1):
            return None
        if cfg.mode == "cycle":  # a test mode: only when asked
            return self._cycle(E, bs, step)
        if cfg.mode == "adaptive" and self.cands.array[k] <= self.cands.max_block and not explored:
            return self._adaptive(E, tokens, k, bs)
        return None

    def _cycle(self, E: np.ndarray, bs: int, step: int) -> Ragged | None:
        cands = self.cands
        pattern = self.cfg.cycle_pattern or cands.widths
        widest = int(cands.array[cands.widest_chain])
        widths = tuple(int(w) if w <= widest else widest
                       for w in (pattern[(step + i) % len(pattern)] for i in range(bs)))
        if len(set(widths)) == 1:
            return None
        e = E[[cands.index[w] for w in widths], np.arange(bs)]
        return widths, 0.0, float(e.mean())

    def _adaptive(self, E: np.ndarray, tokens: np.ndarray, k: int, bs: int) -> Ragged | None:
        """Reused while the (reused) estimate, k and the cost table are unchanged."""
        key = (k, bs, self.cost_model.version)
        if self._for is not None and self._for[0] is E and self._for[1:] == key:
            return self._value
        self._for, self._value = (E, *key), self._assign(E, tokens, k, bs)
        return self._value

    def _assign(self, E: np.ndarray, tokens: np.ndarray, k: int, bs: int) -> Ragged | None:
        cands, cost = self.cands, self.cost_model
        rows = cands.chain_rows
        widths = cands.array[rows]
        cost_row = cost.row(bs)[cands.cost_idx]
        counts, age = cost.active_evidence(bs)
        fresh = ((counts[cands.cost_idx][rows] >= max(4, self.cfg.min_dwell_steps))
                 & (age[cands.cost_idx][rows] <= self.cfg.explore_stale_measurements))
        priced = (widths >= 2) & (fresh | cost.active_seed_measured)
        start = float(tokens[k]) / float(cost_row[k]) * (1.0 + self.cfg.hysteresis)
        chain_cost = cost_row[rows]
        floor = float(chain_cost[0]) if widths[0] == 1 else 0.0
        line = cost.ragged_line(bs)
        learnt = (None if line is None or line.age > self.cfg.explore_stale_measurements
                  else (line, widths.astype(float), chain_cost))
        picks, g = assign(E[rows].T, widths, (widths[priced], chain_cost[priced]), floor, start, learnt)
        if g <= 0.0 or picks.min() == picks.max():
            return None
        e = E[rows][picks, np.arange(bs)]
        return tuple(int(w) for w in widths[picks]), g, float(e.mean())
