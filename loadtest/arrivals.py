"""Open-loop arrival times for loadtest/chat.py --rate (no Locust import: unit-testable)."""
from __future__ import annotations

import random

ARRIVAL_SEED = 0  # every open-loop run draws the same arrival times


class Schedule:
    """Open-loop arrival times: the k-th request is due `at(k)` seconds after the first user asked for one.

    Every user claims the next arrival, sleeps until it is due and sends it: with -u users free the requests
    leave on time; with all of them busy an arrival waits for the first one free (its delay is the `dispatch`
    statistic of the summary). The draws are seeded, so every run sends the same prompts at the same times.
    """

    def __init__(self) -> None:
        self.reset(0.0, "poisson", 0)

    def reset(self, rate: float, arrival: str, total: int) -> None:
        self.rate, self.arrival, self.total = rate, arrival, total  # total 0: no end
        self.rng = random.Random(ARRIVAL_SEED)
        self.times: list[float] = []
        self.t0: float | None = None
        self.claimed = 0

    def at(self, k: int) -> float:
        while len(self.times) <= k:
            gap = self.rng.expovariate(self.rate) if self.arrival == "poisson" else 1.0 / self.rate
            self.times.append(self.times[-1] + gap if self.times else 0.0)
        return self.times[k]

    def claim(self, now: float) -> tuple[int, float] | None:
        """(k, seconds until due; negative: late) of the next arrival, or None when all have been claimed."""
        if self.total and self.claimed >= self.total:
            return None
        if self.t0 is None:
            self.t0 = now
        k = self.claimed
        self.claimed += 1
        return k, self.t0 + self.at(k) - now


def realized_rate(rate: float, arrival: str, warmup: int, measured: int) -> float:
    """The rate the measured arrivals of a run were drawn at: (n - 1) over the time from the first to the last.
    A Poisson sample of 20 arrivals at 1/s is not 1/s (seed 0: 0.74/s); every configuration gets the same."""
    s = Schedule()
    s.reset(rate, arrival, 0)
    if measured < 2:
        return rate
    return (measured - 1) / (s.at(warmup + measured - 1) - s.at(warmup))
