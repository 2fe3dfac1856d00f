"""Synthetic decode workloads for the simulator: acceptance families and requests.

Why separate from simulator.py: what the traffic looks like (acceptance behaviour, lengths) changes for other
reasons than how the server loop is simulated.

Acceptance model. For a draft block starting at a stream position, draft token j matches the target with
conditional probability p_j = sigmoid(logit(p1) + shift - slope * (j - 1)): acceptance decays along the block, as
published DFlash per-position curves do. ``shift`` ~ N(0, request_sigma) per request (some prompts are easier).
A request draws, for every position it may draft from, the run length R = number of leading matches (0..J) under
each phase's p; a verify of width b then accepts min(R, b - 1) and hindsight sees R exactly (greedy).
Switching families alternate between a high and a low phase: per request (independent phases, mean length in
tokens) or synchronised across the whole server (mean length in seconds of server time; a workload shift).

Calibration targets (mean acceptance length tau = committed tokens per request-step at block 16, pooled over
requests; ``tau_at``): code ~ 7, math ~ 6.5 (published DFlash on Qwen3-8B), chat ~ 3.5 (published 3-4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


@dataclass(frozen=True)
class Phase:
    """Acceptance curve of one phase: first-position probability and logit decay per position."""

    p1: float
    slope: float

    def probs(self, J: int, shift: float = 0.0) -> np.ndarray:
        """p_j, j = 1..J."""
        z = _logit(self.p1) + shift - self.slope * np.arange(J)
        return 1.0 / (1.0 + np.exp(-z))


@dataclass(frozen=True)
class AcceptanceFamily:
    """A kind of traffic: one or two phases plus per-request heterogeneity.

    mix: for a mixture family, the member families (each request picks one uniformly); phases are then unused.
    phase_mean: mean phase length (tokens if not ``sync``, seconds of server time if ``sync``); 0 = single phase.
    """

    name: str
    high: Phase
    low: Phase | None = None
    request_sigma: float = 0.5
    phase_mean: float = 0.0
    sync: bool = False
    mix: tuple["AcceptanceFamily", ...] = ()


# p1 calibrated with tau_at to tau16 ~ 7.0 (code) / 6.5 (math) / 3.5 (chat); LOW ~ 1.3 (draft mostly wrong).
CODE = AcceptanceFamily("code", Phase(0.925, 0.12))
MATH = AcceptanceFamily("math", Phase(0.915, 0.12))
CHAT = AcceptanceFamily("chat", Phase(0.80, 0.20))
LOW = Phase(0.23, 0.12)
# prose at temperature 1 with a code drafter (the CPU pair on loadtest/prompts/prose.jsonl commits 1.05-1.08 tokens
# per step at any width): speculation should stay off
PROSE = AcceptanceFamily("prose", Phase(0.06, 0.12))
MIXED = AcceptanceFamily("mixed", CODE.high, mix=(CODE, MATH, CHAT))
# loadtest's code mix (44 code, 9 math, 9 chat prompts) as the bundled CPU pair sees it: its code drafter accepts the
# chat prompts like prose. Members are drawn uniformly, so CODE is listed 5 times (~71 / 14 / 14 %)
CODE_MIX = AcceptanceFamily("code-mix", CODE.high, mix=(CODE,) * 5 + (MATH, PROSE))
SWITCHING = AcceptanceFamily("switching", CODE.high, LOW, phase_mean=256.0)
SWITCHING_SYNC = AcceptanceFamily("switching-sync", CODE.high, LOW, phase_mean=1.0, sync=True)
FAMILIES: dict[str, AcceptanceFamily] = {
    f.name: f for f in (CODE, MATH, CHAT, PROSE, MIXED, CODE_MIX, SWITCHING, SWITCHING_SYNC)
}


def _run_lengths(rng: np.random.Generator, probs: np.ndarray, n: int) -> np.ndarray:
    """n independent run lengths (leading matches, 0..J) under conditional probabilities ``probs``."""
    J = probs.shape[0]
    ok = rng.random((n, J)) < probs
    full = ok.all(axis=1)
    r = np.argmin(ok, axis=1)
    r[full] = J
    return r.astype(np.int64)


@dataclass
class RequestDraws:
    """Everything random about one request, drawn once (common random numbers across policies)."""

    prompt_len: int
    out_len: int
    runs_high: np.ndarray  # [out_len] run length if drafting at that position in the high phase
    runs_low: np.ndarray | None  # same in the low phase (switching families)
    phase_low: np.ndarray | None  # [out_len] bool, per-request phase (unsynchronised switching)
    tokens: np.ndarray  # [out_len + 2 * max_block] the target's (greedy) output tokens
    family: str = ""  # member family actually drawn (mixtures)
    shift: float = 0.0  # logit shift of this request (diagnostics: true p = phase.probs(J, shift))


def draw_request(
    rng: np.random.Generator,
    family: AcceptanceFamily,
    J: int,
    prompt_range: tuple[int, int],
    out_range: tuple[int, int],
    vocab: int = 32000,
) -> RequestDraws:
    """Draw one request of ``family``."""
    if family.mix:
        family = family.mix[int(rng.integers(len(family.mix)))]
    prompt = int(rng.integers(prompt_range[0], prompt_range[1] + 1))
    out = int(rng.integers(out_range[0], out_range[1] + 1))
    shift = float(rng.normal(0.0, family.request_sigma)) if family.request_sigma > 0 else 0.0
    runs_high = _run_lengths(rng, family.high.probs(J, shift), out)
    runs_low = phase_low = None
    if family.low is not None:
        runs_low = _run_lengths(rng, family.low.probs(J, shift), out)
        if not family.sync:
            phase_low = _phase_track(rng, out, family.phase_mean)
    tokens = rng.integers(0, vocab, out + 2 * (J + 1), dtype=np.int64)
    return RequestDraws(prompt, out, runs_high, runs_low, phase_low, tokens, family.name, shift)


def _phase_track(rng: np.random.Generator, n: int, mean: float) -> np.ndarray:
    """Alternating phases with geometric lengths (mean ``mean``), random start; True = low phase."""
    out = np.zeros(n, dtype=bool)
    low = bool(rng.integers(2))
    i = 0
    while i < n:
        length = int(rng.geometric(1.0 / max(mean, 1.0)))
        out[i : i + length] = low
        low = not low
        i += length
    return out


def sync_phase_switch_times(rng: np.random.Generator, duration_s: float, mean_s: float) -> tuple[bool, np.ndarray]:
    """Server-wide phases for synchronised switching: (starts low?, switch times), exponential durations."""
    times = []
    t = 0.0
    while t < duration_s:
        t += float(rng.exponential(mean_s))
        times.append(t)
    return bool(rng.integers(2)), np.asarray(times)


def request_curves(family: AcceptanceFamily, J: int, blocks: np.ndarray, n: int = 4000, seed: int = 12345) -> dict:
    """Exact E_r(b) = 1 + sum_{j<b} prod_{i<=j} p_ri for ``n`` sampled requests, per phase.

    Returns ``{"high": [n, len(blocks)], "low": [n, len(blocks)] (switching families only)}``.
    """
    rng = np.random.default_rng(seed)
    members = family.mix or (family,)
    blocks = np.asarray(blocks, dtype=np.int64)
    out: dict[str, list[np.ndarray]] = {"high": [], "low": []}
    for fam in members:
        m = max(1, n // len(members))
        shifts = rng.normal(0.0, fam.request_sigma, m) if fam.request_sigma > 0 else np.zeros(m)
        phases = [("high", fam.high)] + ([("low", fam.low)] if fam.low is not None else [])
        for key, phase in phases:
            z = _logit(phase.p1) + shifts[:, None] - phase.slope * np.arange(J)[None, :]
            cp = np.cumprod(1.0 / (1.0 + np.exp(-z)), axis=1)
            s = np.concatenate([np.zeros((m, 1)), np.cumsum(cp, axis=1)], axis=1)
            out[key].append(1.0 + s[:, blocks - 1])
    return {k: np.concatenate(v) for k, v in out.items() if v}


def pooled_tokens_per_step(family: AcceptanceFamily, J: int, blocks: np.ndarray) -> np.ndarray:
    """Long-run committed tokens per request-step at each block, pooled over requests (and token-length phases).

    A request with mean E_r spends out_len / E_r steps, so the pool is the harmonic mean of E_r.
    """
    curves = request_curves(family, J, blocks)
    allc = np.concatenate(list(curves.values()))
    return 1.0 / np.mean(1.0 / allc, axis=0)


def tau_at(family: AcceptanceFamily, max_block: int = 16) -> float:
    """Mean acceptance length (pooled committed tokens per request-step) at the full block."""
    return float(pooled_tokens_per_step(family, max_block - 1, np.asarray([max_block]))[0])
