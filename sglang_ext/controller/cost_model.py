"""Step-time table T(batch-size bucket, block size), seeded from a profile and refined online.

Why: the policy divides expected tokens by step time; the step time depends on load (batch) and width (b), and
the knee where verify turns compute-bound is hardware specific, so it is measured rather than assumed.

Two tables, on purpose (tensor-parallel determinism, see policy.py):
  * the LEARNER (seed + EMA of measured step times + measurement counts) lives only where ``observe`` is called:
    TP rank 0. ``export()`` resolves it into a complete, monotone table with a new ``version``.
  * the ACTIVE table is what decisions read (``row``, ``table``, ``version``). It changes ONLY through
    ``load(table)``; every rank loads the same broadcast export, so every rank decides from identical numbers.
    Measuring never changes a decision until the next broadcast.

Resolution of the learner (``export``/``resolve``):
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

from .roofline import RooflineProfile, load_json

DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)
DEFAULT_PROFILE = "h200_qwen3_8b.json"
NEVER = 2**62  # "age" of a never-measured cell
# An unmeasured cell the residual line prices at or below zero takes this share of the cheapest measured step
# instead: a guard, not a model (a narrower width or smaller batch than any measured one costs less, never nothing;
# monotone_table's own floor, 1e-3 of the cheapest cell, made such a width look free).
FILL_FLOOR = 0.25


def _interp_fill(values: np.ndarray, xs: np.ndarray) -> np.ndarray:
    """Fill NaNs of a 1-D array by linear interpolation in ``xs``; extrapolate with a non-negative slope."""
    v = values.copy()
    known = np.isfinite(v)
    nk = int(known.sum())
    if nk == 0 or nk == v.size:
        return v
    kx, ky = xs[known].astype(float), v[known]
    if nk == 1:
        v[~known] = ky[0]
        return v
    v[~known] = np.interp(xs[~known].astype(float), kx, ky)
    lo_slope = max(0.0, (ky[1] - ky[0]) / (kx[1] - kx[0]))
    hi_slope = max(0.0, (ky[-1] - ky[-2]) / (kx[-1] - kx[-2]))
    below = (~known) & (xs < kx[0])
    above = (~known) & (xs > kx[-1])
    v[below] = ky[0] - lo_slope * (kx[0] - xs[below])
    v[above] = ky[-1] + hi_slope * (xs[above] - kx[-1])
    return v


def isotonic(y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least-squares non-decreasing fit (pool adjacent violators). Tiny inputs: plain Python."""
    vals: list[float] = []
    wts: list[float] = []
    sizes: list[int] = []
    for yi, wi in zip(y.tolist(), w.tolist()):
        vals.append(yi)
        wts.append(wi)
        sizes.append(1)
        while len(vals) > 1 and vals[-2] > vals[-1]:
            w2 = wts[-2] + wts[-1]
            v2 = (vals[-2] * wts[-2] + vals[-1] * wts[-1]) / w2
            n2 = sizes[-2] + sizes[-1]
            del vals[-1], wts[-1], sizes[-1]
            vals[-1], wts[-1], sizes[-1] = v2, w2, n2
    return np.repeat(np.asarray(vals), sizes)


def monotone_table(
    cells: np.ndarray,
    buckets: Sequence[int],
    blocks: Sequence[int],
    weights: np.ndarray | None = None,
) -> np.ndarray:
    """Complete a [buckets, blocks] table with NaN holes and make it non-decreasing along both axes.

    Violations are resolved by weighted isotonic regression (a noisy cheap cell and a well-measured dear one meet
    at their weighted mean) rather than a running maximum, which would let one noisy high cell raise every cell
    above it; a running maximum afterwards only guarantees the invariant. Filled holes weigh little.
    """
    t = np.array(cells, dtype=float)
    if not np.isfinite(t).any():
        raise ValueError("cost table: no seeded or measured cell to build from")
    known = np.isfinite(t)
    w = np.ones_like(t) if weights is None else np.array(weights, dtype=float)
    w = np.where(known, np.maximum(w, 1e-6), 0.05)
    bx = np.asarray(buckets, dtype=float)
    kx = np.asarray(blocks, dtype=float)
    for k in range(t.shape[1]):
        t[:, k] = _interp_fill(t[:, k], bx)
    for i in range(t.shape[0]):
        t[i, :] = _interp_fill(t[i, :], kx)
    floor = max(1e-9, float(np.nanmin(t[t > 0])) * 1e-3) if (t > 0).any() else 1e-9
    t = np.maximum(t, floor)
    for i in range(t.shape[0]):
        t[i, :] = isotonic(t[i, :], w[i, :])
    for k in range(t.shape[1]):
        t[:, k] = isotonic(t[:, k], w[:, k])
    t = np.maximum.accumulate(t, axis=1)
    t = np.maximum.accumulate(t, axis=0)
    return t


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
                seed = _rebucket(monotone_table(seed, bk, cands), bk, batch_buckets)
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

    def _residual_shift(self, resid: np.ndarray) -> np.ndarray:
        """[buckets, blocks] shift of the seed: per bucket the measured residuals (measured - seed) as a line in the
        block size, fitted by least squares weighted by measurements (slope >= 0; a bucket with one measured block
        takes the slope of its neighbours), intercept and slope interpolated linearly between measured buckets and
        held flat beyond. Why a line, not the mean: a seed modelled for other hardware has the wrong slope across
        widths -- the packaged H200 roofline is flat in b where a CPU's verify grows linearly with it -- and a
        constant shift then priced an unmeasured chain width far above its real cost from two measured tree widths,
        so the controller never tried it (docs/ADAPTIVE.md)."""
        nb = len(self.batch_buckets)
        x = np.asarray(self.block_sizes, dtype=float)
        slope = np.full(nb, np.nan)
        mean_x = np.full(nb, np.nan)
        mean_r = np.full(nb, np.nan)
        for i in range(nb):
            k = np.isfinite(resid[i])
            if not k.any():
                continue
            wt = self._count[i, k].astype(float)
            xs, ys = x[k], resid[i, k]
            mean_x[i], mean_r[i] = np.average(xs, weights=wt), np.average(ys, weights=wt)
            if np.unique(xs).size >= 2:
                dx = xs - mean_x[i]
                slope[i] = max(0.0, float(np.sum(wt * dx * (ys - mean_r[i])) / np.sum(wt * dx * dx)))
        have = np.isfinite(mean_r)
        if not have.any():
            return np.zeros((nb, len(x)))
        bx = np.asarray(self.batch_buckets, dtype=float)
        fitted = np.isfinite(slope)
        if fitted.any():
            lo = bx[fitted][0]
            # below the smallest fitted bucket the per-width cost shrinks with the batch (a width adds batch x 1
            # tokens): held flat, bucket 4's CPU slope priced widths 1 and 2 at bucket 1 below zero from one
            # measured width 16 (floored to microseconds, so width 2 looked free at one request)
            slope = np.interp(bx, bx[fitted], slope[fitted]) * np.minimum(1.0, bx / lo)
        else:
            slope = np.zeros(nb)
        intercept = mean_r - slope * mean_x
        intercept = np.interp(bx, bx[have], intercept[have])  # linear between measured buckets, flat beyond
        return intercept[:, None] + slope[:, None] * x[None, :]

    def resolve(self) -> np.ndarray:
        """The learner's complete monotone table (see module docstring)."""
        measured = self._count > 0
        cells = np.where(measured, self._est, np.nan)
        resid = np.where(measured & np.isfinite(self._seed), self._est - self._seed, np.nan)
        shifted = self._seed + self._residual_shift(resid)
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
        """The learner's resolved table as plain JSON-able data with a fresh version (broadcast from rank 0)."""
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


def _rebucket(full: np.ndarray, src: Sequence[int], dst: Sequence[int]) -> np.ndarray:
    """Interpolate a complete table onto other batch buckets (linear, clamped at the ends)."""
    out = np.empty((len(dst), full.shape[1]))
    for k in range(full.shape[1]):
        out[:, k] = np.interp(np.asarray(dst, float), np.asarray(src, float), full[:, k])
    return out
