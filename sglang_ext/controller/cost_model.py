"""Step-time table T(batch-size bucket, block size), seeded from a profile and refined online.

Why: the policy divides expected tokens by step time; the step time depends on load (batch) and width (b), and
the knee where verify turns compute-bound is hardware specific, so it is measured rather than assumed.

Two tables, on purpose (tensor-parallel determinism, see policy.py):
  * the LEARNER (seed + EMA of measured step times + measurement counts) lives only where ``observe`` is called:
    TP rank 0. ``export()`` resolves it into a complete, monotone table with a new ``version``.
  * the ACTIVE table is what decisions read (``row``, ``table``, ``version``). It changes ONLY through
    ``load(table)``; every rank loads the same broadcast export, so every rank decides from identical numbers.
    Measuring never changes a decision until the next broadcast.

Resolution of the learner (``export``/``resolve``; the numerics in table_fit.py):
  1. a measured cell is its EMA (the seed counts as ``seed_weight`` pseudo-measurements, then a constant weight);
  2. an unmeasured seeded cell is its seed shifted by its bucket's (measured - seed) residuals fitted as a line in
     b (additive where one block is measured: e.g. KV reads that grew since profiling cost the same at every b;
     a slope where a seed modelled for other hardware grows slower in b than this machine), interpolated linearly
     in batch size from the measured buckets and held flat beyond them -- except the slope below the smallest
     bucket with one, which shrinks in proportion to the batch; a price at or below zero becomes FILL_FLOOR of
     the cheapest measured step;
  3. cells with neither are interpolated linearly along batch size, then along block size, and extrapolated with
     the nearest non-negative slope;
  4. the table is projected to be non-decreasing in block size, then in batch size, by weighted isotonic
     regression (weights = measurements + seed weight), then a running maximum guards the invariant.
Ragged steps (a width per request) are no cell's cost: their times teach their own line per bucket
(``observe_ragged``, ragged_price.py), exported and loaded with the table.
Batch sizes map to the smallest bucket >= B (CUDA graphs pad up); beyond the last bucket rows are extrapolated
linearly and measurements are not recorded.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from .probe_price import ProbePrice
from .ragged_price import Line, RaggedPrice
from .roofline import RooflineProfile, load_json
from .table_fit import monotone_table, rebucket, residual_shift

DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)
DEFAULT_PROFILE = "h200_qwen3_8b.json"
NEVER = 2**62  # "age" of a never-measured cell
# An unmeasured cell the residual line prices at or below zero takes this share of the cheapest measured step
# instead: a guard, not a model (a narrower width or smaller batch than any measured one costs less, never nothing;
# monotone_table's own floor, 1e-3 of the cheapest cell, made such a width look free).
FILL_FLOOR = 0.25
# The steps right after a probe that count toward its price (at most): those at the probe's width and batch bucket
# that cost more than their price, up to the first that does not. Why: a probe runs the drafter over the whole
# batch's block and writes its draft KV; the target's next steps run colder, a cost of the probe that its own step
# time does not show (docs/BENCHMARKS.md, plain runs). They stay in their width's cell too: leaving them out of it
# (an earlier design) left the cell its cheaper steps only, and code at greedy, which probes every few steps, ran
# wider than it paid.
PROBE_AFTERMATH_STEPS = 4


class CostModel:
    """Seeded, online-refined, monotone step-time table (see module docstring for the two-table contract)."""

    def __init__(
        self,
        batch_buckets: Sequence[int],
        block_sizes: Sequence[int],
        seed: np.ndarray | Sequence[Sequence[float]] | None = None,
        *,
        ema: float = 0.1,
        seed_weight: float = 2.0,
        seed_measured: bool = False,
    ) -> None:
        bk = [int(b) for b in batch_buckets]
        bl = [int(b) for b in block_sizes]
        if not bk or any(b < 1 for b in bk) or any(b2 <= b1 for b1, b2 in zip(bk, bk[1:])):
            raise ValueError(f"batch_buckets: must be strictly increasing ints >= 1, got {batch_buckets!r}")
        if not bl or any(b < 1 for b in bl) or any(b2 <= b1 for b1, b2 in zip(bl, bl[1:])):
            raise ValueError(f"block_sizes: must be strictly increasing ints >= 1, got {block_sizes!r}")
        if not (0.0 < ema <= 1.0):
            raise ValueError(f"ema: must be in (0, 1], got {ema}")
        self.batch_buckets: tuple[int, ...] = tuple(bk)
        self.block_sizes: tuple[int, ...] = tuple(bl)
        self._block_index = {b: k for k, b in enumerate(bl)}
        shape = (len(bk), len(bl))
        s = np.full(shape, np.nan) if seed is None else np.array(seed, dtype=float)
        if s.shape != shape:
            raise ValueError(f"seed: shape {s.shape} does not match (buckets, blocks) = {shape}")
        s[~(s > 0)] = np.nan  # non-positive / NaN = unseeded
        self.ema = float(ema)
        self.seed_weight = float(seed_weight)
        self.seed_measured = bool(seed_measured)  # profiled on this machine (trusted) vs modelled / a guess
        self._seed = s
        self._est = np.full(shape, np.nan)
        self._count = np.zeros(shape, dtype=np.int64)
        self._clock = 0  # measurements folded in so far (the learner's clock)
        self._last = np.full(shape, -1, dtype=np.int64)  # clock at each cell's latest measurement
        self._active_count = np.zeros(shape, dtype=np.int64)  # what the active table says (broadcast)
        self._active_age = np.full(shape, NEVER, dtype=np.int64)
        self._active_seed_measured = self.seed_measured
        self.dropped_measurements = 0
        self._active = monotone_table(s, bk, bl) if np.isfinite(s).any() else np.full(shape, np.nan)
        self._version = 0
        self._next_version = 1
        self._row_cache: dict[int, np.ndarray] = {}
        self.probe_price = ProbePrice(bk, self.ema)  # a probe's extra time, broadcast with the table
        self.ragged_price = RaggedPrice(bk, self.ema)  # ragged steps' measured line, broadcast with the table
        self._aftermath: tuple[int, int, float, int] | None = None  # probe being priced: bucket, width, extra, left

    # -- construction -----------------------------------------------------------------------------------------
    @classmethod
    def from_profile(
        cls,
        path_or_dict: str | Path | Mapping[str, Any],
        candidates: Sequence[int],
        *,
        ema: float = 0.1,
        batch_buckets: Sequence[int] | None = None,
    ) -> "CostModel":
        """Build from a profile: a measured table or a roofline description.

        Measured: ``{"batch_buckets": [...], "block_sizes": [...], "seconds": [[...]]}`` (e.g. written by startup
        profiling; cells for blocks that are not candidates are ignored, missing ones interpolated). Trusted
        (``seed_measured``): the policy explores such cells only when they look competitive.
        Roofline: see roofline.py; seeded at ``seed_context_tokens`` per request (default 1024). A model, not a
        measurement: the policy measures every cell of a bucket in use at least once.
        """
        d = load_json(path_or_dict)
        cands = [int(b) for b in candidates]
        if "seconds" in d:
            bk = [int(b) for b in d.get("batch_buckets", ())]
            bl = [int(b) for b in d.get("block_sizes", ())]
            sec = np.asarray(d["seconds"], dtype=float)
            if sec.shape != (len(bk), len(bl)):
                raise ValueError(f"seconds: shape {sec.shape} does not match (batch_buckets, block_sizes)")
            seed = np.full((len(bk), len(cands)), np.nan)
            for k, b in enumerate(cands):
                if b in bl:
                    seed[:, k] = sec[:, bl.index(b)]
            if batch_buckets is not None and [int(b) for b in batch_buckets] != bk:
                seed = rebucket(monotone_table(seed, bk, cands), bk, batch_buckets)
                bk = [int(b) for b in batch_buckets]
            return cls(bk, cands, seed, ema=ema, seed_measured=True)
        prof = RooflineProfile.from_dict(d)
        bk = list(batch_buckets or d.get("batch_buckets") or DEFAULT_BUCKETS)
        ctx = float(d.get("seed_context_tokens", 1024))
        seed = np.array([[prof.step_time(B, b, B * ctx) for b in cands] for B in bk])
        return cls(bk, cands, seed, ema=ema)

    @classmethod
    def default(cls, candidates: Sequence[int], *, ema: float = 0.1) -> "CostModel":
        """The packaged H200 + Qwen3-8B roofline: right shape, possibly wrong scale until measured online."""
        text = resources.files(__package__).joinpath("profiles", DEFAULT_PROFILE).read_text(encoding="utf-8")
        return cls.from_profile(json.loads(text), candidates, ema=ema)

    # -- learner (TP rank 0 only; see policy.py) -----------------------------------------------------------------
    def bucket_index(self, batch_size: int) -> int:
        """Index of the smallest bucket >= batch_size (== len(buckets) beyond the last)."""
        return bisect.bisect_left(self.batch_buckets, batch_size)

    def observe(self, batch_size: int, block_size: int, seconds: float) -> None:
        """Fold one measured step time into the learner (never into the active table)."""
        k = self._block_index.get(int(block_size))
        if k is None:
            raise ValueError(f"block_size: {block_size} is not one of {self.block_sizes}")
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"seconds: must be a finite positive number, got {seconds!r}")
        i = self.bucket_index(int(batch_size))
        if batch_size < 1 or i >= len(self.batch_buckets):
            self.dropped_measurements += 1
            return
        if self._aftermath is not None:
            self._after_probe(i, k, int(batch_size), float(seconds))
        n = int(self._count[i, k]) + 1
        self._count[i, k] = n
        self._clock += 1
        self._last[i, k] = self._clock
        cur = self._est[i, k]
        seed = self._seed[i, k]
        if math.isnan(cur):
            cur = seed if math.isfinite(seed) else float(seconds)
        prior = self.seed_weight if math.isfinite(seed) else 0.0
        w = max(self.ema, 1.0 / (n + prior))
        self._est[i, k] = cur + w * (float(seconds) - cur)

    def observe_probe(self, batch_size: int, block_size: int, seconds: float) -> None:
        """Price one probe step (probe_price.py): its time less the active table's price of its width, plus its
        aftermath (PROBE_AFTERMATH_STEPS), folded in once the aftermath is over (or at the next export)."""
        self._price_probe()
        k = self._block_index.get(int(block_size))
        i = self.bucket_index(int(batch_size))
        if k is None or batch_size < 1 or i >= len(self.batch_buckets) or not np.isfinite(self._active).all():
            return
        if isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0:
            extra = float(seconds) - float(self.row(int(batch_size))[k])
            self._aftermath = (i, k, extra, PROBE_AFTERMATH_STEPS)

    def _after_probe(self, i: int, k: int, batch_size: int, seconds: float) -> None:
        """A step measured while a probe is being priced: what it cost over its price is the probe's while it is
        the probe's aftermath (PROBE_AFTERMATH_STEPS); the first that is not ends the pricing."""
        bucket, width, extra, left = self._aftermath  # type: ignore[misc]
        over = seconds - float(self.row(batch_size)[k])
        if (i, k) == (bucket, width) and left > 0 and over > 0:
            self._aftermath = (bucket, width, extra + over, left - 1)
            if left > 1:
                return
        self._price_probe()

    def _price_probe(self) -> None:
        """Fold the probe being priced into the probe price."""
        if self._aftermath is not None:
            bucket, _, extra, _ = self._aftermath
            self._aftermath = None
            self.probe_price.observe(bucket, extra)

    def observe_ragged(self, batch_size: int, rows: int, seconds: float) -> None:
        """Fold one ragged step's time (``rows`` verify rows in all) into its bucket's line (ragged_price.py)."""
        i = self.bucket_index(int(batch_size))
        if batch_size < 1 or i >= len(self.batch_buckets):
            self.dropped_measurements += 1
            return
        if isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0:
            self.ragged_price.observe(i, rows / batch_size, float(seconds), self._clock)

    def ragged_line(self, batch_size: int) -> Line | None:
        """The active line of ragged steps at ``batch_size``'s bucket (ragged_price.py; None: too few measured).
        Beyond the last bucket: None (its rows are extrapolated, its measurements not recorded)."""
        i = self.bucket_index(int(batch_size))
        return None if i >= len(self.batch_buckets) else self.ragged_price.line(i)

    def probe_seconds(self, batch_size: int) -> float | None:
        """The active price of a probe at ``batch_size`` (probe_price.py; None before one was measured)."""
        return self.probe_price.seconds(int(batch_size), self.bucket_index(int(batch_size)))

    def resolve(self) -> np.ndarray:
        """The learner's complete monotone table (see module docstring)."""
        measured = self._count > 0
        cells = np.where(measured, self._est, np.nan)
        resid = np.where(measured & np.isfinite(self._seed), self._est - self._seed, np.nan)
        shifted = self._seed + residual_shift(resid, self._count, self.batch_buckets, self.block_sizes)
        fill = (~measured) & np.isfinite(self._seed)
        if measured.any():  # a line extrapolated far below its points must not price a step as free
            shifted = np.where(shifted > 0, shifted, FILL_FLOOR * float(self._est[measured].min()))
        cells[fill] = shifted[fill]
        if not np.isfinite(cells).any():
            return self._active.copy()
        weights = np.where(measured, self._count + self.seed_weight, self.seed_weight)
        return monotone_table(cells, self.batch_buckets, self.block_sizes, weights)

    def measurement_counts(self) -> np.ndarray:
        """How many step times each cell has absorbed (learner side)."""
        return self._count.copy()

    # -- broadcast -----------------------------------------------------------------------------------------------
    def export(self) -> dict[str, Any]:
        """The learner's resolved table as plain JSON-able data with a fresh version (broadcast from rank 0). A probe
        still being priced is priced with the aftermath seen so far."""
        self._price_probe()
        v = self._next_version
        self._next_version += 1
        return {
            "version": v,
            "batch_buckets": list(self.batch_buckets),
            "block_sizes": list(self.block_sizes),
            "seconds": self.resolve().tolist(),
            "measurements": self._count.tolist(),
            "age": np.where(self._last >= 0, self._clock - self._last, NEVER).tolist(),
            "seed_measured": self.seed_measured,
            "probe_extra": self.probe_price.export(),
            "ragged": self.ragged_price.export(self._clock),
        }

    def load(self, table: Mapping[str, Any]) -> None:
        """Make ``table`` (an ``export()`` result) the active table used by decisions."""
        bk = tuple(int(b) for b in table.get("batch_buckets", ()))
        bl = tuple(int(b) for b in table.get("block_sizes", ()))
        if bk != self.batch_buckets:
            raise ValueError(f"batch_buckets: table has {bk}, model has {self.batch_buckets}")
        if bl != self.block_sizes:
            raise ValueError(f"block_sizes: table has {bl}, model has {self.block_sizes}")
        sec = np.asarray(table.get("seconds"), dtype=float)
        if sec.shape != (len(bk), len(bl)) or not np.isfinite(sec).all() or (sec <= 0).any():
            raise ValueError("seconds: must be a complete table of finite positive numbers")
        version = table.get("version")
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"version: must be an int >= 0, got {version!r}")
        shape = sec.shape
        counts = np.asarray(table.get("measurements", np.zeros(shape)), dtype=np.int64)
        age = np.asarray(table.get("age", np.full(shape, NEVER)), dtype=np.int64)
        if counts.shape != shape or age.shape != shape:
            raise ValueError("measurements/age: must have the shape of seconds")
        self.probe_price.load(table.get("probe_extra"))
        self.ragged_price.load(table.get("ragged"))
        self._active = np.maximum.accumulate(np.maximum.accumulate(sec, axis=1), axis=0)
        self._active_count = counts
        self._active_age = age
        self._active_seed_measured = bool(table.get("seed_measured", False))
        self._version = version
        self._next_version = max(self._next_version, version + 1)
        self._row_cache.clear()

    # -- active table (what decisions read) ------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """Version of the active table (0 = the seed every rank built identically)."""
        return self._version

    def active_evidence(self, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """(measurement counts, age in measurements) of the active table's row for ``batch_size``.

        Part of the broadcast table, hence identical on every rank; lets the policy explore cells that were
        never (or long ago) measured. Beyond the last bucket: the last bucket's evidence.
        """
        i = min(self.bucket_index(batch_size), len(self.batch_buckets) - 1)
        return self._active_count[i], self._active_age[i]

    def active_measured_near(self, batch_size: int, factor: float = 2.0) -> np.ndarray:
        """Per block: measured at some bucket within ``factor`` of ``batch_size``'s bucket (active table's counts).

        Why: an unmeasured cell next to a measured one of the same width is priced from that measurement (the
        residual line of ``resolve``), not from the seed alone; the policy's try-once rule for never-measured cells
        is for widths whose cost near this load is still a guess."""
        bx = np.asarray(self.batch_buckets, dtype=float)
        i = min(self.bucket_index(batch_size), len(bx) - 1)
        near = (bx >= bx[i] / factor) & (bx <= bx[i] * factor)
        return (self._active_count[near] > 0).any(axis=0)

    @property
    def active_seed_measured(self) -> bool:
        """Whether the active table's seed was profiled on this machine (else: modelled; explore more)."""
        return self._active_seed_measured

    @property
    def table(self) -> np.ndarray:
        """Copy of the active [buckets, blocks] table."""
        return self._active.copy()

    def row(self, batch_size: int) -> np.ndarray:
        """Active step times for every block at ``batch_size`` (do not mutate; cached until the next load)."""
        r = self._row_cache.get(batch_size)
        if r is not None:
            return r
        if not np.isfinite(self._active).all():
            raise ValueError("cost table: no seed and nothing loaded yet; load() a table first")
        i = self.bucket_index(batch_size)
        t = self._active
        if i < t.shape[0]:
            r = t[i]
        elif t.shape[0] == 1:
            r = t[0] * (batch_size / self.batch_buckets[0])
        else:
            b1, b2 = self.batch_buckets[-2], self.batch_buckets[-1]
            slope = np.maximum(0.0, (t[-1] - t[-2]) / (b2 - b1))
            r = np.maximum.accumulate(t[-1] + slope * (batch_size - b2))
        if len(self._row_cache) < 4096:
            self._row_cache[batch_size] = r
        return r
