"""What a probe adds to its step, measured: the price the probe schedule spaces far probes by.

Why: a probe (probes.py) drafts the full block at a width that would draft less -- at width 1 it drafts where the
step would draft nothing --, and writes the draft KV its draft reads first. On a workload the drafter cannot guess
that is pure cost, paid for the chance to find out it can; its size depends on the batch (every row drafts the
full block) and the machine (a draft on CPU is compute, several decode steps' worth at a large batch). Spacing far
probes by a fixed count of steps charged a large batch several times what a small one paid: the schedule spaces
them so that their measured price stays within a share of decode time (``probe_budget``) instead.

Contract:
  * ``observe(bucket, extra)`` (TP rank 0, the cost model's learner side): one probe step's time less the active
    table's price of its width at its batch bucket, with the colder steps right after it over their price
    (``CostModel.observe_probe``); an EMA per bucket (the first measurement taken whole).
  * ``export()`` / ``load()``: the learner's values ride the cost table's broadcast (cost_model.py), so every rank
    spaces probes by identical numbers; ``seconds(batch_size)`` reads only what was loaded.
  * ``seconds(batch_size)``: the loaded price at ``batch_size``'s bucket; an unmeasured bucket takes the nearest
    measured one's scaled by the ratio of batch sizes (a probe drafts every row of the batch); None before any
    probe was measured.
Invariants: prices are >= 0; pure Python + numpy.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


class ProbePrice:
    """Learned extra seconds of a probe step per batch bucket (module contract)."""

    def __init__(self, batch_buckets: Sequence[int], ema: float) -> None:
        self.batch_buckets = tuple(int(b) for b in batch_buckets)
        self.ema = float(ema)
        self._est = np.full(len(self.batch_buckets), np.nan)
        self._active = self._est.copy()
        self._cache: dict[int, float | None] = {}  # batch size -> price, until the next load (asked every step)

    def observe(self, bucket: int, extra: float) -> None:
        if not (0 <= bucket < len(self.batch_buckets)) or not math.isfinite(extra):
            return
        extra = max(0.0, float(extra))
        cur = self._est[bucket]
        self._est[bucket] = extra if math.isnan(cur) else cur + self.ema * (extra - cur)

    def export(self) -> list[float | None]:
        return [None if math.isnan(v) else float(v) for v in self._est]

    def load(self, values: Sequence[float | None] | None) -> None:
        """Make an ``export()`` result active; None or a missing list (a table from before probe prices) clears."""
        self._cache.clear()
        if values is None:
            self._active = np.full(len(self.batch_buckets), np.nan)
            return
        if len(values) != len(self.batch_buckets):
            raise ValueError(f"probe_extra: {len(values)} values for {len(self.batch_buckets)} batch buckets")
        arr = np.array([np.nan if v is None else float(v) for v in values], dtype=float)
        if (arr[np.isfinite(arr)] < 0).any() or np.isinf(arr).any():
            raise ValueError("probe_extra: prices must be finite and >= 0 (or null: unmeasured)")
        self._active = arr

    def seconds(self, batch_size: int, bucket: int) -> float | None:
        """The loaded price of a probe at ``batch_size`` (its bucket index ``bucket``, clamped to the table)."""
        if batch_size not in self._cache:
            self._cache[batch_size] = self._price(batch_size, bucket)
        return self._cache[batch_size]

    def _price(self, batch_size: int, bucket: int) -> float | None:
        measured = np.flatnonzero(np.isfinite(self._active))
        if measured.size == 0:
            return None
        i = min(max(bucket, 0), len(self.batch_buckets) - 1)
        if np.isfinite(self._active[i]):
            return float(self._active[i])
        j = int(measured[np.argmin(np.abs(measured - i))])
        return float(self._active[j]) * max(1, int(batch_size)) / self.batch_buckets[j]
