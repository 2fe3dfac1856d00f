"""Width calibration: how many draft tokens a width's own steps accept, against what the estimate predicted for them.

Why: the per-position acceptance estimate (acceptance.py) is one curve for every width, learned mostly from full
drafts (hindsight of probes and of width-B steps). But a DFlash drafter attends within its block both ways, so what
it proposes at position j depends on how many positions it drafts: where the worker drafts only the b positions it
verifies (CPU, ``prefix_drafts``), a width-b draft is not the first b positions of a full one: a one-position
draft guesses worse than the curve predicts, a few positions better, enough to keep the controller on too wide a
width (docs/ADAPTIVE.md). What the curve misses is measured here, per width, from that width's own steps -- the way
tree_gain.py measures a tree against chain B.

Contract:
  * ``WidthCalibration(widths)``: ``observe(width, accepted, predicted)`` folds one step that ran ``width`` with the
    drafter's natural draft for it (not a probe's full draft): ``accepted`` [bs] the draft tokens each request
    accepted, ``predicted`` [bs] the draft tokens the estimate expected (E_r(width) - 1), both before the step fed
    the estimate;
  * ``ratio()`` [len(widths)]: observed over predicted accepted drafts, each shrunk toward 1 by ``prior_strength``
    request-steps of the width's mean prediction and clipped to [RATIO_MIN, RATIO_MAX]; the controller scales a
    request's expected draft tokens at that width by it: E_r(b) = 1 + ratio_b (E_r(b) - 1).
Invariants: pure numpy, no torch, no SGLang; every TP rank feeds identical accept counts and estimates, so every
rank holds identical ratios (decisions read them); decay is per step of the width, so evidence waits while the
width does not run; a width that never ran keeps ratio 1 (the curve's own prediction).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .tree_gain import check_decay_and_prior

# Bounds on a ratio: a guard against a handful of steps with near-zero predictions, not a model.
RATIO_MIN, RATIO_MAX = 0.5, 2.0


class WidthCalibration:
    """Decayed observed / predicted accepted drafts per width (module contract)."""

    def __init__(self, widths: Sequence[int], *, decay: float = 0.99, prior_strength: float = 8.0) -> None:
        check_decay_and_prior(decay, prior_strength)
        self.widths = tuple(int(w) for w in widths)
        self._index = {w: i for i, w in enumerate(self.widths)}
        self.decay = float(decay)
        self.prior_strength = float(prior_strength)
        self._observed = np.zeros(len(self.widths))
        self._predicted = np.zeros(len(self.widths))
        self._n = np.zeros(len(self.widths))
        self.steps = np.zeros(len(self.widths), dtype=np.int64)  # steps that measured each width
        self.version = 0  # bumped by every observation
        self._ratio = np.ones(len(self.widths))

    def __contains__(self, width: int) -> bool:
        return int(width) in self._index

    def observe(self, width: int, accepted: np.ndarray, predicted: np.ndarray) -> None:
        """One step of ``width`` (module contract)."""
        i = self._index.get(int(width))
        if i is None:
            raise ValueError(f"width: {width!r} is not calibrated {self.widths}")
        a = np.asarray(accepted, dtype=float).reshape(-1)
        p = np.asarray(predicted, dtype=float).reshape(-1)
        if a.shape != p.shape:
            raise ValueError(f"accepted and predicted: expected one entry per request each, got {a.shape} and {p.shape}")
        self._observed[i] = self._observed[i] * self.decay + a.sum()
        self._predicted[i] = self._predicted[i] * self.decay + p.sum()
        self._n[i] = self._n[i] * self.decay + a.shape[0]
        self.steps[i] += 1
        self.version += 1
        mean = self._predicted[i] / self._n[i] if self._n[i] > 0 else 0.0
        prior = self.prior_strength * mean
        denom = self._predicted[i] + prior
        self._ratio[i] = 1.0 if denom <= 0.0 else float(np.clip((self._observed[i] + prior) / denom,
                                                                  RATIO_MIN, RATIO_MAX))

    def ratio(self) -> np.ndarray:
        """Observed over predicted accepted drafts per width (1 before any evidence); read-only."""
        r = self._ratio.view()
        r.setflags(write=False)
        return r
