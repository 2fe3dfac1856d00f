"""Discrete-time simulator of a DFlash decode server, driving the REAL controller.

Why: to measure the controller's regret against every fixed block size and against a per-batch-size oracle on a
modelled H200, without a GPU, and to catch regressions in the policy.

What the controller sees is only what a real server gives it (policy.py worker contract): per step the request
ids, the chosen width, accepted counts, the full drafted block (when drafted) and the committed tokens, one step
late (overlap scheduling, ``feedback_lag``), plus the measured step time (rank 0) and periodic cost-table syncs.
It never sees the true acceptance probabilities or the roofline.

Server model:
  * requests: closed loop at concurrency C (a finished request is replaced at once) or Poisson arrivals (queue,
    at most ``max_running`` in the batch); prompt and output lengths uniform; prefill is not modelled (a new request
    joins the decode batch with its prompt already in the KV cache).
  * tokens: each request has a fixed greedy target output; a draft at stream position ``pos`` matches its first
    R[pos] tokens (R drawn by the workload family); the worker drafts the full block whenever b > 1 or the
    controller asks for a probe; a verify of width b commits min(R, b - 1) + 1 tokens.
  * time: roofline.step_time(batch, b, sum of context lengths, drafted) times log-normal noise (``noise_sigma``);
    the controller's measurement is that (noisy) time.
  * cost seed: ``startup`` = a table profiled at startup at short context (``startup_context`` tokens per
    request), each cell the mean of ``startup_repeats`` timings with the same noise, like profiling during
    CUDA-graph capture; ``roofline`` = the packaged default
    profile (CostModel.default); ``flat`` = every cell equal (no prior knowledge; online learning only).
Common random numbers: the i-th request and the noise stream are identical across policies for a given seed.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from sglang_ext.controller.config import ControllerConfig
from sglang_ext.controller.cost_model import DEFAULT_BUCKETS, CostModel
from sglang_ext.controller.policy import BlockSizeController
from sglang_ext.controller.roofline import RooflineProfile
from harness.workload import FAMILIES, AcceptanceFamily, draw_request, request_curves, sync_phase_switch_times


@dataclass(frozen=True)
class SimConfig:
    """One simulated run."""

    family: str = "math"
    concurrency: int = 8
    duration_s: float = 12.0
    warmup_s: float = 1.0
    seed: int = 0
    arrival: str = "closed"  # "closed" | "poisson"
    rate_rps: float = 0.0  # Poisson arrival rate (requests/s)
    max_running: int = 0  # Poisson: batch cap (0 = concurrency)
    prompt_range: tuple[int, int] = (128, 1536)
    out_range: tuple[int, int] = (256, 2048)
    noise_sigma: float = 0.03
    feedback_lag: int = 1
    max_block: int = 16
    cost_seed: str = "startup"  # "startup" | "roofline" | "flat"
    startup_context: int = 256
    startup_repeats: int = 8


@dataclass
class SimResult:
    """Outcome of one run (measurement window = after warm-up)."""

    policy: str
    family: str
    concurrency: int
    seed: int
    tokens_per_s: float
    tpot_ms: float  # mean over requests started and finished in the window (nan if none)
    token_tpot_ms: float  # request-time per output token: sum(batch * step time) / tokens, in the window
    steps: int
    mean_batch: float
    mean_block: float
    switches: int
    finished: int
    block_share: dict[str, float] = field(default_factory=dict)


def _startup_table(
    prof: RooflineProfile, candidates: Sequence[int], sim: "SimConfig", rng: np.random.Generator
) -> dict[str, Any]:
    """Startup profiling: mean of ``startup_repeats`` noisy timings per cell at a short context."""
    buckets = list(DEFAULT_BUCKETS)
    ctx, n = sim.startup_context, max(1, sim.startup_repeats)
    sec = [
        [
            prof.step_time(B, b, B * ctx) * float(np.mean(np.exp(rng.normal(0.0, sim.noise_sigma, n))))
            for b in candidates
        ]
        for B in buckets
    ]
    return {"batch_buckets": buckets, "block_sizes": list(candidates), "seconds": sec}


def make_cost_model(
    prof: RooflineProfile, ctrl_cfg: ControllerConfig, sim: SimConfig, rng: np.random.Generator
) -> CostModel:
    """The controller's cost model as a real server would start it (see ``cost_seed``)."""
    cands = list(ctrl_cfg.candidates_for(sim.max_block))
    if sim.cost_seed == "startup":
        table = _startup_table(prof, cands, sim, rng)
        return CostModel.from_profile(table, cands, ema=ctrl_cfg.cost_ema)
    if sim.cost_seed == "roofline":
        return CostModel.default(cands, ema=ctrl_cfg.cost_ema)
    if sim.cost_seed == "flat":
        flat = np.full((len(DEFAULT_BUCKETS), len(cands)), prof.step_time(1, 1, 0.0))
        return CostModel(DEFAULT_BUCKETS, cands, flat, ema=ctrl_cfg.cost_ema)
    raise ValueError(f"cost_seed: unknown {sim.cost_seed!r}")


class _Pool:
    """Running requests as dense rows (vectorised per-step work)."""

    def __init__(self, cap: int, J: int, max_len: int) -> None:
        self.J = J
        self.tokens = np.zeros((cap, max_len), dtype=np.int64)
        self.runs_high = np.zeros((cap, max_len), dtype=np.int64)
        self.runs_low = np.zeros((cap, max_len), dtype=np.int64)
        self.phase_low = np.zeros((cap, max_len), dtype=bool)
        self.has_low = np.zeros(cap, dtype=bool)
        self.pos = np.zeros(cap, dtype=np.int64)
        self.out_len = np.zeros(cap, dtype=np.int64)
        self.prompt = np.zeros(cap, dtype=np.int64)
        self.start_t = np.zeros(cap)
        self.rid = np.full(cap, -1, dtype=np.int64)
        self.active = np.zeros(cap, dtype=bool)

    def admit(self, row: int, rid: int, draws: Any, t: float) -> None:
        n = draws.out_len
        self.tokens[row, : draws.tokens.shape[0]] = draws.tokens
        self.runs_high[row, :n] = draws.runs_high
        self.has_low[row] = draws.runs_low is not None
        if draws.runs_low is not None:
            self.runs_low[row, :n] = draws.runs_low
        self.phase_low[row, :n] = draws.phase_low if draws.phase_low is not None else False
        self.pos[row] = 0
        self.out_len[row] = n
        self.prompt[row] = draws.prompt_len
        self.start_t[row] = t
        self.rid[row] = rid
        self.active[row] = True


def run(
    sim: SimConfig, prof: RooflineProfile, ctrl_cfg: ControllerConfig, policy_name: str | None = None
) -> SimResult:
    """Simulate one server run under ``ctrl_cfg`` (any mode) and return its measurements."""
    fam: AcceptanceFamily = FAMILIES[sim.family]
    J = sim.max_block - 1
    rng_req = np.random.default_rng([sim.seed, 1])
    rng_noise = np.random.default_rng([sim.seed, 2])
    rng_arr = np.random.default_rng([sim.seed, 3])
    rng_phase = np.random.default_rng([sim.seed, 4])
    rng_seed = np.random.default_rng([sim.seed, 5])
    ctrl = BlockSizeController(ctrl_cfg, make_cost_model(prof, ctrl_cfg, sim, rng_seed), sim.max_block, True)

    cap = sim.concurrency if sim.arrival == "closed" else (sim.max_running or sim.concurrency)
    pool = _Pool(cap, J, sim.out_range[1] + 2 * sim.max_block)
    arJ = np.arange(J, dtype=np.int64)
    sync_low0, sync_switch = (False, np.zeros(0))
    if fam.low is not None and fam.sync:
        sync_low0, sync_switch = sync_phase_switch_times(rng_phase, sim.duration_s, fam.phase_mean)

    queue: deque[float] = deque()
    next_arrival = float(rng_arr.exponential(1.0 / sim.rate_rps)) if sim.arrival == "poisson" else math.inf
    next_rid = 0
    t = 0.0
    pending: deque[tuple] = deque()
    tokens_win = 0
    req_time_win = 0.0
    steps_win = 0
    batch_sum = 0
    block_sum = 0
    block_steps: dict[int, int] = {}
    tpots: list[float] = []

    def apply(obs: tuple) -> None:
        ids, b, acc, drafted, committed, bs, secs, probe, finished = obs
        ctrl.observe_step(ids, b, acc, drafted, committed)
        ctrl.observe_step_time(bs, b, secs, probe=probe)
        if ctrl.cost_sync_due:
            ctrl.sync_cost_table()
        for rid in finished:
            ctrl.finish(rid)

    while t < sim.duration_s:
        # admissions
        if sim.arrival == "closed":
            for row in np.flatnonzero(~pool.active):
                pool.admit(int(row), next_rid, draw_request(rng_req, fam, J, sim.prompt_range, sim.out_range), t)
                next_rid += 1
        else:
            while next_arrival <= t:
                queue.append(next_arrival)
                next_arrival += float(rng_arr.exponential(1.0 / sim.rate_rps))
            free = np.flatnonzero(~pool.active)
            for row in free[: len(queue)]:
                queue.popleft()
                pool.admit(int(row), next_rid, draw_request(rng_req, fam, J, sim.prompt_range, sim.out_range), t)
                next_rid += 1
            if not pool.active.any():
                t = next_arrival
                continue
        rows = np.flatnonzero(pool.active)
        bs = rows.shape[0]
        ids = pool.rid[rows].tolist()
        d = ctrl.decide(ids)
        b = d.block_size
        pos = pool.pos[rows]
        if fam.low is not None and fam.sync:
            low_now = sync_low0 ^ bool(np.searchsorted(sync_switch, t, side="right") % 2)
            low = np.full(bs, low_now) & pool.has_low[rows]
        else:
            low = pool.phase_low[rows, pos] & pool.has_low[rows]
        R = np.where(low, pool.runs_low[rows, pos], pool.runs_high[rows, pos])
        acc = np.minimum(R, b - 1)
        drafted = None
        if d.draft_full:
            drafted = pool.tokens[rows[:, None], pos[:, None] + arJ]
            drafted = np.where(arJ[None, :] >= R[:, None], drafted + 1, drafted)  # +1: a certain mismatch
        counts = acc + 1
        flat = pool.tokens[np.repeat(rows, counts), np.repeat(pos, counts) + (
            np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts))].tolist()
        committed = []
        o = 0
        for c in counts.tolist():
            committed.append(flat[o : o + c])
            o += c
        ctx = float((pool.prompt[rows] + pos).sum())
        secs = prof.step_time(bs, b, ctx, drafted=d.draft_full) * math.exp(rng_noise.normal(0.0, sim.noise_sigma))
        t_end = t + secs
        useful = np.minimum(counts, pool.out_len[rows] - pos)
        if t >= sim.warmup_s:
            tokens_win += int(useful.sum())
            req_time_win += bs * secs
            steps_win += 1
            batch_sum += bs
            block_sum += b
            block_steps[b] = block_steps.get(b, 0) + 1
        pool.pos[rows] = pos + counts
        done = rows[pool.pos[rows] >= pool.out_len[rows]]
        finished = pool.rid[done].tolist()
        for row in done.tolist():
            if pool.start_t[row] >= sim.warmup_s and t_end <= sim.duration_s:
                tpots.append((t_end - pool.start_t[row]) / pool.out_len[row])
            pool.active[row] = False
        t = t_end
        pending.append((ids, b, acc, drafted, committed, bs, secs, d.probe, finished))
        while len(pending) > sim.feedback_lag:
            apply(pending.popleft())

    window = max(t - sim.warmup_s, 1e-12)
    total_steps = max(steps_win, 1)
    return SimResult(
        policy=policy_name or _policy_label(ctrl_cfg),
        family=sim.family,
        concurrency=sim.concurrency,
        seed=sim.seed,
        tokens_per_s=tokens_win / window,
        tpot_ms=1e3 * float(np.mean(tpots)) if tpots else float("nan"),
        token_tpot_ms=1e3 * req_time_win / max(tokens_win, 1),
        steps=steps_win,
        mean_batch=batch_sum / total_steps,
        mean_block=block_sum / total_steps,
        switches=ctrl.switches,
        finished=len(tpots),
        block_share={str(k): v / total_steps for k, v in sorted(block_steps.items())},
    )


def _policy_label(cfg: ControllerConfig) -> str:
    if cfg.mode == "fixed":
        return f"fixed-{cfg.fixed_block}"
    if cfg.mode == "schedule":
        return "schedule"
    return "adaptive"


def steady_context_per_request(sim: SimConfig) -> float:
    """Mean context length of a running request in steady state (prompt + age of a renewal process)."""
    p = 0.5 * (sim.prompt_range[0] + sim.prompt_range[1])
    lo, hi = sim.out_range
    n = np.arange(lo, hi + 1, dtype=float)
    return p + float((n * n).mean() / (2.0 * n.mean()))


def oracle_blocks(
    prof: RooflineProfile,
    family: str,
    candidates: Sequence[int],
    batch_sizes: Sequence[int],
    context_per_request: float,
    max_block: int = 16,
) -> dict[int, int]:
    """Best fixed block per batch size, knowing the TRUE acceptance curves and the TRUE (noise-free) step times.

    Tokens per request-step are pooled as the harmonic mean over requests (and per-request phases); for
    server-wide (synchronised) phases the goodputs of the two phases are averaged, each phase lasting as long.
    """
    fam = FAMILIES[family]
    cands = [b for b in candidates if b <= max_block]
    blocks = np.asarray(cands)
    curves = request_curves(fam, max_block - 1, blocks)
    out: dict[int, int] = {}
    for B in batch_sizes:
        T = np.asarray([prof.step_time(B, b, B * context_per_request) for b in cands])
        if fam.low is not None and fam.sync:
            good = np.mean([B * (1.0 / np.mean(1.0 / c, axis=0)) / T for c in curves.values()], axis=0)
        else:
            allc = np.concatenate(list(curves.values()))
            good = B * (1.0 / np.mean(1.0 / allc, axis=0)) / T
        out[int(B)] = int(cands[int(np.argmax(good))])
    return out


def result_dict(r: SimResult) -> dict[str, Any]:
    """JSON-able result."""
    return asdict(r)


def sim_config_dict(s: SimConfig) -> Mapping[str, Any]:
    """JSON-able sim config."""
    d = asdict(s)
    d["prompt_range"] = list(s.prompt_range)
    d["out_range"] = list(s.out_range)
    return d
