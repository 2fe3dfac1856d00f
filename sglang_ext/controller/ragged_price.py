"""What a ragged step costs, learnt from ragged steps: the price per-request widths are chosen by.

Why: a ragged step (ragged.py) runs sum_r b_r rows, and was priced as the batch-wide step of its mean width,
interpolated between measured widths. That is a guess: a ragged step also groups its attention by width, drafts
and appends rows a batch-wide step lays out alike, and on a busy machine its cost is whatever it is. So the
steps that run are measured, and once a batch bucket has some, its ragged steps are priced from them.

Contract:
  * ``observe(bucket, mean_width, seconds, clock)`` (TP rank 0, the cost model's learner side): one ragged step of
    a batch in ``bucket`` that ran ``mean_width`` = rows / batch size verify rows per request; decayed sums of a
    weighted least-squares line of seconds in mean width (each step's weight decays by ``1 - ema`` per later step
    of its bucket, the first ones averaged alike).
  * ``export(clock)`` / ``load()``: the learner's sums ride the cost table's broadcast (cost_model.py), so every
    rank prices ragged steps from identical numbers; ``line(bucket)`` reads only what was loaded.
  * ``line(bucket)``: the bucket's ``Line`` once it has ``MIN_STEPS`` ragged steps, else None (the caller keeps
    the interpolation). ``Line.prices(m, table_at)`` prices mean widths ``m``: the line through the measured mean
    (x̄, ȳ) whose slope is ridge-shrunk toward the batch-wide table's own slope between x̄ and m (``RIDGE``, in
    width²): ragged steps all at one mean width shift the table by what they measured there; steps spread over
    widths teach their own slope. Never a negative slope (more rows cost no less).
Invariants: pure Python + numpy; sums are finite and weights >= 0; a loaded line is identical on every rank.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

MIN_STEPS = 4  # ragged steps of a bucket before their line prices it: one step's time is one busy moment
RIDGE = 1.0  # width²: data spread over one width either side of their mean outweigh the table's slope
_FIELDS = 7  # steps, weight, Σx, Σy, Σxx, Σxy (weighted), widest mean width seen


@dataclass(frozen=True)
class Line:
    """The loaded ragged-step evidence of one batch bucket (weighted moments of mean width x and seconds y)."""

    steps: int
    mean_width: float
    seconds: float
    var: float  # weighted variance of x
    cov: float  # weighted covariance of x and y
    widest: float  # the widest mean width a ragged step of this bucket ran
    age: int  # cost measurements since this bucket's last ragged step

    def prices(self, m: np.ndarray, table_at: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """Seconds of ragged steps of mean widths ``m``; ``table_at``: the batch-wide table's price at a width."""
        m = np.asarray(m, dtype=float)
        x0 = self.mean_width
        dx = m - x0
        far = np.abs(dx) > 1e-9
        prior = np.where(far, (table_at(m) - table_at(np.full_like(m, x0))) / np.where(far, dx, 1.0), 0.0)
        slope = np.maximum(0.0, (self.cov + RIDGE * prior) / (self.var + RIDGE))
        return self.seconds + slope * dx


class RaggedPrice:
    """Learnt ragged-step prices per batch bucket (module contract)."""

    def __init__(self, batch_buckets: Sequence[int], ema: float) -> None:
        self.batch_buckets = tuple(int(b) for b in batch_buckets)
        self.ema = float(ema)
        self._sums = np.zeros((len(self.batch_buckets), _FIELDS))
        self._last = np.full(len(self.batch_buckets), -1, dtype=np.int64)  # the cost clock at the last step
        self._active: list[Line | None] = [None] * len(self.batch_buckets)

    def observe(self, bucket: int, mean_width: float, seconds: float, clock: int) -> None:
        if not (0 <= bucket < len(self.batch_buckets)) or not (math.isfinite(mean_width) and math.isfinite(seconds)):
            return
        if seconds <= 0 or mean_width < 1:
            return
        s = self._sums[bucket]
        s[1:6] *= 1.0 - self.ema
        x, y = float(mean_width), float(seconds)
        s[:6] += (1.0, 1.0, x, y, x * x, x * y)
        s[6] = max(s[6], x)
        self._last[bucket] = clock

    def export(self, clock: int) -> list[list[float] | None]:
        return [None if s[0] == 0 else [*map(float, s), float(clock - last)]
                for s, last in zip(self._sums, self._last)]

    def load(self, values: Sequence[Sequence[float] | None] | None) -> None:
        """Make an ``export()`` result active; None (a table from before ragged prices) clears."""
        if values is None:
            self._active = [None] * len(self.batch_buckets)
            return
        if len(values) != len(self.batch_buckets):
            raise ValueError(f"ragged: {len(values)} entries for {len(self.batch_buckets)} batch buckets")
        self._active = [None if v is None else _line(v) for v in values]

    def line(self, bucket: int) -> Line | None:
        """The loaded line of ``bucket`` (clamped to the table) once it has MIN_STEPS ragged steps."""
        ln = self._active[min(max(bucket, 0), len(self.batch_buckets) - 1)]
        return ln if ln is not None and ln.steps >= MIN_STEPS else None


def _line(v: Sequence[float]) -> Line:
    a = np.asarray(v, dtype=float)
    if a.shape != (_FIELDS + 1,) or not np.isfinite(a).all() or (a[:2] <= 0).any() or a[7] < 0:
        raise ValueError(f"ragged: a bucket's entry must be {_FIELDS + 1} finite numbers, steps and weight > 0")
    steps, w, sx, sy, sxx, sxy, widest, age = a
    x, y = sx / w, sy / w
    return Line(int(steps), x, y, max(0.0, sxx / w - x * x), sxy / w - x * y, widest, int(age))
