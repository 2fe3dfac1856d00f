"""Completing a step-cost table: filling holes, shifting a seed by measured residuals, projecting to monotone.

Why: the cost model's learner (cost_model.py) resolves a table from a seed and sparse measurements; this is the
numerics of that resolution, which changes with how a table is fitted, not with how it is learned or broadcast.

Contract: ``monotone_table(cells, buckets, blocks, weights)`` completes a [buckets, blocks] table with NaN holes and
makes it non-decreasing along both axes (pooled runs along the widths spread out: ``spread_pooled``);
``isotonic(y, w)`` is the weighted non-decreasing least-squares fit it uses; ``residual_shift(resid, counts,
buckets, blocks)`` is the seed's shift from the measured residuals; ``rebucket(full, src, dst)`` interpolates a
complete table onto other batch buckets.
Invariants: pure numpy, deterministic (every TP rank that resolves the same inputs gets the same table).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


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


def spread_pooled(y: np.ndarray, xs: np.ndarray, w: np.ndarray, raw: np.ndarray) -> np.ndarray:
    """An isotonic fit ``y`` of ``raw`` along the widths with each pooled run (equal consecutive values where
    ``raw``'s were not: a violation pooled, not a measured equality) spread out: its
    best-measured cell keeps the pooled value, the narrower cells of the run lie on the line from the value before
    the run to it, the wider ones on the line from it to the value after the run (a run at an end of the row stays
    flat on that side). Why: pooling makes the violators equal, and a wider width priced at a narrower one's cost
    looks free -- a sparsely measured width 4 cell pooled into width 2's was chosen for a few percent more tokens
    (docs/ADAPTIVE.md); a wider verify never costs nothing more. Still non-decreasing."""
    out = y.copy()
    n, i = len(y), 0
    while i < n:
        j = i
        while j + 1 < n and y[j + 1] == y[i]:
            j += 1
        if j > i and not np.all(raw[i:j + 1] == raw[i]):
            v = y[i]
            k = i + int(np.argmax(w[i:j + 1]))
            if i > 0:
                left, xl = y[i - 1], xs[i - 1]
                for m in range(i, k):
                    out[m] = left + (v - left) * (xs[m] - xl) / (xs[k] - xl)
            if j + 1 < n:
                right, xr = y[j + 1], xs[j + 1]
                for m in range(k + 1, j + 1):
                    out[m] = v + (right - v) * (xs[m] - xs[k]) / (xr - xs[k])
        i = j + 1
    return out


def monotone_table(
    cells: np.ndarray,
    buckets: Sequence[int],
    blocks: Sequence[int],
    weights: np.ndarray | None = None,
) -> np.ndarray:
    """Complete a [buckets, blocks] table with NaN holes and make it non-decreasing along both axes.

    Violations are resolved by weighted isotonic regression (a noisy cheap cell and a well-measured dear one meet
    at their weighted mean) rather than a running maximum, which would let one noisy high cell raise every cell
    above it; along the widths the pooled cells are then spread between their neighbours (``spread_pooled``); a
    running maximum afterwards only guarantees the invariant. Filled holes weigh little.
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
    # a row or column already non-decreasing is its own fit (nothing pooled, nothing to spread): only the others
    # are fitted -- the table is resolved at every cost sync, and a learned table is mostly monotone
    for i in np.flatnonzero((np.diff(t, axis=1) < 0).any(axis=1)):
        t[i, :] = spread_pooled(isotonic(t[i, :], w[i, :]), kx, w[i, :], t[i, :])
    for k in np.flatnonzero((np.diff(t, axis=0) < 0).any(axis=0)):
        t[:, k] = isotonic(t[:, k], w[:, k])
    t = np.maximum.accumulate(t, axis=1)
    t = np.maximum.accumulate(t, axis=0)
    return t


def residual_shift(resid: np.ndarray, counts: np.ndarray, buckets: Sequence[int],
                   blocks: Sequence[int]) -> np.ndarray:
    """[buckets, blocks] shift of the seed: per bucket the measured residuals (measured - seed) as a line in the
    block size, fitted by least squares weighted by measurements (slope >= 0; a bucket with one measured block
    takes the slope of its neighbours), intercept and slope interpolated linearly between measured buckets and
    held flat beyond. Why a line, not the mean: a seed modelled for other hardware has the wrong slope across
    widths -- the packaged H200 roofline is flat in b where a CPU's verify grows linearly with it -- and a
    constant shift then priced an unmeasured chain width far above its real cost from two measured tree widths,
    so the controller never tried it (docs/ADAPTIVE.md)."""
    nb = len(buckets)
    x = np.asarray(blocks, dtype=float)
    slope = np.full(nb, np.nan)
    mean_x = np.full(nb, np.nan)
    mean_r = np.full(nb, np.nan)
    for i in range(nb):
        k = np.isfinite(resid[i])
        if not k.any():
            continue
        wt = counts[i, k].astype(float)
        xs, ys = x[k], resid[i, k]
        total = wt.sum()
        mean_x[i], mean_r[i] = float(wt @ xs) / total, float(wt @ ys) / total
        if xs.size >= 2:  # the block sizes are distinct: two measured widths fit a line
            dx = xs - mean_x[i]
            slope[i] = max(0.0, float(np.sum(wt * dx * (ys - mean_r[i])) / np.sum(wt * dx * dx)))
    have = np.isfinite(mean_r)
    if not have.any():
        return np.zeros((nb, len(x)))
    bx = np.asarray(buckets, dtype=float)
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


def rebucket(full: np.ndarray, src: Sequence[int], dst: Sequence[int]) -> np.ndarray:
    """Interpolate a complete table onto other batch buckets (linear, clamped at the ends)."""
    out = np.empty((len(dst), full.shape[1]))
    for k in range(full.shape[1]):
        out[:, k] = np.interp(np.asarray(dst, float), np.asarray(src, float), full[:, k])
    return out
