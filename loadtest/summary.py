"""Exact per-run statistics for `chat.py --summary-file` (what the sweep reads; no Locust import).

Locust's own stats round response times into buckets (2 significant digits) and know no token counts or
measurement window; this keeps every sample so percentiles are exact and throughput is measured over the
steady-state part of the run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from loadtest.sse import StreamTimings

METRICS = ("ttft", "itl", "tpot", "e2e", "output_tokens", "client_tokenize")
UNITS = {"ttft": "ms", "itl": "ms", "tpot": "ms", "e2e": "ms", "output_tokens": "tokens", "client_tokenize": "ms"}
QUANTILES = (50, 90, 99)


def describe(values: list[float]) -> dict:
    """count, mean, p50/p90/p99 (linear interpolation, as numpy), min, max; `count: 0` alone when empty."""
    if not values:
        return {"count": 0}
    a = np.asarray(values, dtype=float)
    out = {"count": int(a.size), "mean": float(a.mean()), "min": float(a.min()), "max": float(a.max())}
    out |= {f"p{q}": float(v) for q, v in zip(QUANTILES, np.percentile(a, QUANTILES))}
    return out


class Completion(NamedTuple):
    """One completed request, on the recorder's clock (seconds)."""

    done_at: float
    output_tokens: int
    sent_at: float
    first_token_at: float


@dataclass
class RunRecorder:
    """Completed requests of one run, with their completion times (seconds, any monotonic clock)."""

    started_at: float | None = None
    stopped_at: float | None = None
    samples: dict[str, list[float]] = field(default_factory=lambda: {m: [] for m in METRICS})
    completions: list[Completion] = field(default_factory=list)
    first_done: dict[object, float] = field(default_factory=dict)          # user -> its first completion
    last_done: dict[object, float] = field(default_factory=dict)           # user -> its latest completion
    dispatch_delays_ms: list[float] = field(default_factory=list)  # open loop: how late each arrival left
    unmeasured: list[Completion] = field(default_factory=list)     # open loop: warm-up arrivals, tokens only

    def reset(self, now: float) -> None:
        """Forget everything (Locust's "reset stats"): the run restarts now."""
        self.__init__(started_at=now)

    def record(self, user: object, done_at: float, t: StreamTimings, client_ms: list[float] = ()) -> None:
        """One completed request; `client_ms`: the client's own work on each of its chunks (chat.py
        --client-tokenizer), if any."""
        self.samples["client_tokenize"].extend(client_ms)
        self.samples["ttft"].append(t.ttft * 1e3)
        self.samples["itl"].extend(x * 1e3 for x in t.itl)
        if t.tpot is not None:
            self.samples["tpot"].append(t.tpot * 1e3)
        self.samples["e2e"].append(t.e2e * 1e3)
        self.samples["output_tokens"].append(t.output_tokens)
        sent_at = done_at - t.e2e
        self.completions.append(Completion(done_at, t.output_tokens, sent_at, sent_at + t.ttft))
        self.first_done.setdefault(user, done_at)
        self.last_done[user] = done_at

    def record_unmeasured(self, done_at: float, t: StreamTimings) -> None:
        """A warm-up arrival of an open-loop run: not in any statistic, but its tokens count where they fall
        inside the measured window."""
        sent_at = done_at - t.e2e
        self.unmeasured.append(Completion(done_at, t.output_tokens, sent_at, sent_at + t.ttft))

    def throughput(self, end: float, users: int | None = None) -> dict:
        """Output tokens/s and requests/s over the steady-state window [A, B].

        A = the moment every user has finished one request (all users start together: before A the server fills
        up). B = the moment the first user finished its last request, so every token any user received in [A, B]
        belongs to a completed, recorded request (a user's requests run one after another). Each request's
        tokens are spread over its decode span: the first token at its arrival, the other n - 1 evenly from then
        to the end of the stream; the tokens falling inside [A, B] count. Requests likewise, each spread over its
        lifetime. Why not count the requests completed in the window: users that start together finish in
        bursts a request latency apart, so whether the last burst lands inside the window decides a third of the
        count when a request takes a third of the window: in tests/unit/test_loadtest_summary.py's case (32 users,
        20 s) that count read 0.99 of the true rate at 4.94 s per request and 0.69 at 5.1 s.
        When the window is too short to mean anything, falls back to the run's start up to its last completion,
        flagged `window: whole run`.
        """
        first = min((c.done_at for c in self.completions), default=end)
        start = self.started_at if self.started_at is not None else first
        whole = max(end - start, 1e-9)
        total = sum(c.output_tokens for c in self.completions)
        out = {"output_tokens_total": total, "completed": len(self.completions), "duration_s": whole}
        a = max(self.first_done.values(), default=end)
        b = min(self.last_done.values(), default=end)
        window = b - a
        done_inside = sum(1 for c in self.completions if a < c.done_at <= b)
        everyone = users is None or len(self.first_done) >= users
        # a window under a quarter of the run, or with fewer completions than users, is mostly noise
        if everyone and window >= 0.25 * whole and done_inside >= max(2, len(self.first_done)):
            tokens = sum(_tokens_inside(c, a, b) for c in self.completions)
            requests = sum(_overlap(c.sent_at, c.done_at, a, b) / max(c.done_at - c.sent_at, 1e-9)
                           for c in self.completions)
            return out | {"output_tok_s": tokens / window, "req_s": requests / window,
                          "window": "steady", "window_s": window}
        # up to the last completion, not the end: nothing completes after it, and the cut-off tail would only
        # add time without tokens
        last = max((c.done_at for c in self.completions), default=end)
        span = max(last - start, 1e-9)
        return out | {"output_tok_s": total / span, "req_s": len(self.completions) / span,
                      "window": "whole run", "window_s": span}

    def open_loop_throughput(self, end: float) -> dict:
        """Open loop (chat.py --rate): output tok/s and requests/s over the window [A, B] from the first measured
        request's send to the last one's. Every request runs to its end (the run waits for them), so every token
        received in the window is recorded: the measured requests' and the warm-up arrivals' still streaming at
        A, each request's tokens spread over its decode span as in `throughput`, requests over their lifetimes.
        Below saturation req/s is then the offered rate; above it, what the server sustains. (Counting up to
        the last completion instead, as vLLM's and SGLang's serving benchmarks do, adds the drain after the
        last arrival: a 20-request point at 1 req/s read 0.7 req/s.) A window under a second falls back to the
        first send up to the last completion, flagged `window: whole run`."""
        total = sum(c.output_tokens for c in self.completions)
        out = {"output_tokens_total": total, "completed": len(self.completions)}
        a = min((c.sent_at for c in self.completions), default=end)
        b = max((c.sent_at for c in self.completions), default=end)
        if b - a >= 1.0 and len(self.completions) >= 2:
            every = self.completions + self.unmeasured
            tokens = sum(_tokens_inside(c, a, b) for c in every)
            requests = sum(_overlap(c.sent_at, c.done_at, a, b) / max(c.done_at - c.sent_at, 1e-9) for c in every)
            return out | {"duration_s": b - a, "output_tok_s": tokens / (b - a), "req_s": requests / (b - a),
                          "window": "steady", "window_s": b - a}
        last = max((c.done_at for c in self.completions), default=end)
        span = max(last - a, 1e-9)
        return out | {"duration_s": span, "output_tok_s": total / span, "req_s": len(self.completions) / span,
                      "window": "whole run", "window_s": span}

    def goodput(self, req_s: float, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> dict:
        """Requests/s that met both SLOs (TTFT <= slo_ttft_ms, TPOT <= slo_tpot_ms; None: no limit), as the
        completed requests' share that met them times req_s; and the median per-user decode speed, 1000 / TPOT
        of each request (tokens/s one user sees while its answer streams: the Pareto plot's x axis)."""
        good = 0
        speeds = []
        for c in self.completions:
            ttft = (c.first_token_at - c.sent_at) * 1e3
            tpot = (c.done_at - c.first_token_at) * 1e3 / (c.output_tokens - 1) if c.output_tokens > 1 else None
            if tpot:
                speeds.append(1e3 / tpot)
            good += ((slo_ttft_ms is None or ttft <= slo_ttft_ms)
                     and (slo_tpot_ms is None or tpot is None or tpot <= slo_tpot_ms))
        share = good / len(self.completions) if self.completions else None
        return {"slo_met": good, "slo_met_share": share, "goodput_req_s": req_s * share if share is not None else None,
                "user_tok_s": float(np.median(speeds)) if speeds else None}

    def summary(self, end: float, requests: int, failures: int, users: int | None = None, rate: float | None = None,
                slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None, **meta) -> dict:
        """The JSON `--summary-file` holds: run metadata, counts, throughput, goodput and every metric's
        distribution. `rate`: an open-loop run's request rate (chat.py --rate)."""
        tp = self.open_loop_throughput(end) if rate else self.throughput(end, users)
        return {
            **meta,
            "users": users,
            "rate": rate,
            "slo_ttft_ms": slo_ttft_ms,
            "slo_tpot_ms": slo_tpot_ms,
            "requests": requests,
            "failures": failures,
            "failure_ratio": failures / requests if requests else None,
            **tp,
            **self.goodput(tp["req_s"], slo_ttft_ms, slo_tpot_ms),
            "dispatch_delay_ms": describe(self.dispatch_delays_ms) if rate else None,
            "metrics": {m: {"unit": UNITS[m], **describe(self.samples[m])} for m in METRICS},
        }


def _overlap(lo: float, hi: float, a: float, b: float) -> float:
    """Length of (lo, hi] inside (a, b]."""
    return max(0.0, min(hi, b) - max(lo, a))


def _tokens_inside(c: Completion, a: float, b: float) -> float:
    """A completed request's tokens received inside (a, b]: the first at its arrival, the rest evenly after it."""
    done, n, first = c.done_at, c.output_tokens, c.first_token_at
    if n <= 0:
        return 0.0
    inside = 1.0 if a < first <= b else 0.0
    if n > 1:
        inside += (n - 1) * (_overlap(first, done, a, b) / (done - first) if done > first else float(a < done <= b))
    return inside
