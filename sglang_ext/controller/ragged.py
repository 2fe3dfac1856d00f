"""Per-request verify widths: which width each request of a batch verifies in a ragged step.

Why: one width per batch makes a request the drafter cannot guess verify as wide as the ones it guesses well, and on
a verify that is compute on every token (CPU, a GPU past its knee) those rows cost as much as useful ones. A ragged
step -- request r drafts and verifies b_r positions, exactly what a batch-wide width-b_r step would run for it --
runs sum_r b_r draft and verify rows, as many as a batch-wide step of the mean width m = mean(b_r).

``ragged_cost(points, floor, b, learnt)`` prices it. Once ragged steps of this batch bucket were measured
(``learnt``: their line, ragged_price.py, with the batch's chain widths and their table prices), from them: the
line at m, never below ``floor`` (width 1's), infinite past both the widest mean width a ragged step ran and the
widest measured drafted width. Before that, from the batch's measured drafted widths (``points``: (width, seconds)
of the cells with measurements, widths >= 2, increasing): interpolated between the two measured widths around m,
the narrowest measured width's cost below it, never below ``floor``, infinite above the widest. Only measured
cells: an unmeasured one is an extrapolation (docs/HISTORY.md).

``assign(E, widths, points, floor, start, learnt)`` -> (picks, goodput): from every request at the narrowest
width, widen one request one step at a time in order of tokens gained per row added (E_r is concave in b), so each
prefix of that order is the most tokens for its rows; every prefix is priced and the best kept (``picks`` indexes
``widths``).
Where the price is flat the best assignment can lie between two prefixes: tests/unit/controller/test_ragged.py
bounds the gap to the brute-force best.

Invariants: pure numpy (no torch, no SGLang), deterministic (a stable sort: ties go to the earlier request and its
narrower step), so every TP rank assigns the same widths from the same inputs; the goodput returned is that of the
picks at their price.
"""
from __future__ import annotations

import numpy as np

from .ragged_price import Line

Points = tuple[np.ndarray, np.ndarray]  # (drafted widths >= 2 with measured costs, increasing; their seconds)
Learnt = tuple[Line, np.ndarray, np.ndarray]  # (the bucket's ragged line; chain widths, increasing; their prices)


def ragged_cost(points: Points, floor: float, b: np.ndarray, learnt: Learnt | None = None) -> float:
    """The price of a ragged step whose requests verify ``b`` (module docstring)."""
    return float(_prices(points, floor, np.asarray([np.mean(b)], dtype=float), learnt)[0])


def _prices(points: Points, floor: float, m: np.ndarray, learnt: Learnt | None = None) -> np.ndarray:
    w, t = (np.asarray(x, dtype=float) for x in points)
    if learnt is not None:
        line, cw, ct = learnt
        price = line.prices(m, lambda x: np.interp(x, cw, ct))
        top = max(line.widest, float(w[-1]) if len(w) else 0.0)
    else:
        price = np.where(m <= w[0], t[0], np.interp(m, w, t))
        top = float(w[-1])
    return np.where(m > top + 1e-9, np.inf, np.maximum(price, floor))


def assign(E: np.ndarray, widths: np.ndarray, points: Points, floor: float,
           start: float, learnt: Learnt | None = None) -> tuple[np.ndarray, float]:
    """E: [bs, W] expected committed tokens of every request at every width ``widths`` [W] (increasing);
    ``points``/``floor``/``learnt``: the price (``ragged_cost``); ``start``: the goodput to beat (tokens per
    second). Returns (picks [bs] indices into ``widths``, goodput of the picks); goodput 0.0 when none found beats
    ``start`` (or nothing prices a drafted width: ``points`` empty and nothing learnt)."""
    bs, n = E.shape
    if (len(points[0]) == 0 and learnt is None) or n < 2:
        return np.zeros(bs, dtype=np.intp), 0.0
    w = np.asarray(widths, dtype=float)
    dw = np.diff(w)  # [n - 1] rows each step adds
    dE = np.diff(E, axis=1)  # [bs, n - 1] tokens each step adds
    gain = np.minimum.accumulate(dE / dw, axis=1)  # per row added, made non-increasing (the request's hull)
    order = np.argsort(-gain.reshape(-1), kind="stable")  # request-major flat index: ties to the earlier request
    tokens = E[:, 0].sum() + np.concatenate([[0.0], np.cumsum(dE.reshape(-1)[order])])
    rows = bs * w[0] + np.concatenate([[0.0], np.cumsum(np.tile(dw, bs)[order])])
    goodput = tokens / _prices(points, floor, rows / bs, learnt)
    best = int(np.argmax(goodput))  # the first of equals: the fewest rows
    picks = np.bincount(order[:best] // (n - 1), minlength=bs).astype(np.intp)
    g = float(goodput[best])
    return picks, (g if g > start else 0.0)
