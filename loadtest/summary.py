"""Exact per-run statistics for `chat.py --summary-file` (what the sweep reads; no Locust import).

Locust's own stats round response times into buckets (2 significant digits) and know no token counts or
measurement window; this keeps every sample so percentiles are exact and throughput is measured over the
steady-state part of the run.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from loadtest.sse import StreamTimings

METRICS = ("ttft", "itl", "tpot", "e2e", "output_tokens")
UNITS = {"ttft": "ms", "itl": "ms", "tpot": "ms", "e2e": "ms", "output_tokens": "tokens"}
QUANTILES = (50, 90, 99)


def describe(values: list[float]) -> dict:
    """count, mean, p50/p90/p99 (linear interpolation, as numpy), min, max; `count: 0` alone when empty."""
    if not values:
        return {"count": 0}
    a = np.asarray(values, dtype=float)
    out = {"count": int(a.size), "mean": float(a.mean()), "min": float(a.min()), "max": float(a.max())}
    out |= {f"p{q}": float(v) for q, v in zip(QUANTILES, np.percentile(a, QUANTILES))}
    return out


@dataclass
class RunRecorder:
    """Completed requests of one run, with their completion times (seconds, any monotonic clock)."""

    started_at: float | None = None
    stopped_at: float | None = None
    samples: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in METRICS})
    completions: list[tuple[float, int]] = field(default_factory=list)      # (done_at, output_tokens)
    first_done: dict[object, float] = field(default_factory=dict)          # user -> its first completion

    def reset(self, now: float) -> None:
        """Forget everything (Locust's "reset stats"): the run restarts now."""
        self.__init__(started_at=now)

    def record(self, user: object, done_at: float, t: StreamTimings) -> None:
        self.samples["ttft"].append(t.ttft * 1e3)
        self.samples["itl"].extend(x * 1e3 for x in t.itl)
        if t.tpot is not None:
            self.samples["tpot"].append(t.tpot * 1e3)
        self.samples["e2e"].append(t.e2e * 1e3)
        self.samples["output_tokens"].append(t.output_tokens)
        self.completions.append((done_at, t.output_tokens))
        self.first_done.setdefault(user, done_at)

    def throughput(self, end: float, users: int | None = None) -> dict:
        """Output tokens/s of completed requests over the steady-state window.

        All users start together, so the first completions arrive in a burst after a full request latency and
        requests still running at the end are cut off. Counting completions between "every user has finished one
        request" and the end is unbiased in a steady closed loop (requests running across either edge balance
        out). When that window is too short to mean anything, falls back to the run's start up to its last
        completion, flagged `window: whole run`.
        """
        start = self.started_at if self.started_at is not None else min((d for d, _ in self.completions), default=end)
        whole = max(end - start, 1e-9)
        total = sum(n for _, n in self.completions)
        out = {"output_tokens_total": total, "completed": len(self.completions), "duration_s": whole}
        steady_from = max(self.first_done.values(), default=end)
        in_window = [(d, n) for d, n in self.completions if steady_from < d <= end]
        window = end - steady_from
        everyone = users is None or len(self.first_done) >= users
        # a window under a quarter of the run, or with fewer completions than users, is mostly noise
        if everyone and window >= 0.25 * whole and len(in_window) >= max(2, len(self.first_done)):
            tokens = sum(n for _, n in in_window)
            return out | {"output_tok_s": tokens / window, "req_s": len(in_window) / window,
                          "window": "steady", "window_s": window}
        # up to the last completion, not the end: nothing completes after it, and the cut-off tail would only
        # add time without tokens
        last = max((d for d, _ in self.completions), default=end)
        span = max(last - start, 1e-9)
        return out | {"output_tok_s": total / span, "req_s": len(self.completions) / span,
                      "window": "whole run", "window_s": span}

    def summary(self, end: float, requests: int, failures: int, users: int | None = None, **meta) -> dict:
        """The JSON `--summary-file` holds: run metadata, counts, throughput and every metric's distribution."""
        return {
            **meta,
            "users": users,
            "requests": requests,
            "failures": failures,
            "failure_ratio": failures / requests if requests else None,
            **self.throughput(end, users),
            "metrics": {m: {"unit": UNITS[m], **describe(self.samples[m])} for m in METRICS},
        }
