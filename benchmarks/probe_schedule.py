"""What the controller's probes cost and how fast they turn drafting back on: the real ControllerLoop, simulated steps.

One request decodes under DFLASH_ADAPTIVE's controller (sglang_ext.controller_loop, defaults unless overridden):
first `--steps` steps where each drafted position is accepted with probability `--low` (the drafter guesses a
little: speculation should be off), then `--steps` steps at `--high` (it should come back on). Step times fed to
the loop: width 1 `--t1`, a width-1 probe (the full draft runs) `--t-probe`, a drafted width b `--t-wide` + b x
0.2 ms (the CPU pair's shape, benchmarks/results/step_profile_cpu.md). Per configuration over `--seeds` runs:
  probe rate   probes per width-1 step in the low phase after its first 100 steps (a probe costs a draft forward,
               ~0.45 of a width-1 step on CPU);
  turn-on      steps of the high phase before the first drafted width (mean, p90).

    python benchmarks/probe_schedule.py [--seeds 40] [--out benchmarks/results/probe_schedule.json]
    # 16 requests on CPU (bucket-16 step times of benchmarks/results/cost_table_cpu_code16.json), 30 % jitter:
    python benchmarks/probe_schedule.py --requests 16 --noise 0.3 --seeds 20 --low 0.06 --t1 0.0145 --t-probe 0.028 \
        --t-wide 0.0125 --t-per-width 0.0026 --out benchmarks/results/probe_schedule_16.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sglang_ext.controller.config import ControllerConfig  # noqa: E402
from sglang_ext.controller_loop import ControllerLoop, LaunchedStep  # noqa: E402
from sglang_ext.settings import AdaptiveSettings  # noqa: E402

B = 16
CONFIGS = {  # name -> ControllerConfig overrides
    "as shipped": {},
    "no near probes": {"probe_near_interval": 0},
}


class Host:
    """A host copy that has arrived (what the worker's CPU tensors are after SGLang's copy-done sync)."""

    def __init__(self, a: np.ndarray) -> None:
        self.a = a

    def numpy(self) -> np.ndarray:
        return self.a


def run(cfg: ControllerConfig, phases: list[float], steps: int, rng: np.random.Generator,
        times: tuple[float, float, float, float], requests: int = 1, noise: float = 0.0) -> list[tuple[int, bool]]:
    """(width, drafted) per step of `requests` requests through `phases` (per-position acceptance), `steps` each;
    step times x a lognormal factor of sigma `noise` (a real server's jitter, which moves the learned cost table)."""
    t1, t_probe, t_wide, t_per_width = times
    loop = ControllerLoop(AdaptiveSettings(cfg), B, is_rank0=True)
    rids = [f"r{i}" for i in range(requests)]
    now, log = 0.0, []
    pos = np.zeros(requests, dtype=np.int64)
    for p in phases:
        for _ in range(steps):
            d = loop.begin_decode(rids, now)
            b = d.block_size
            # per request, the drafted block matches the stream for run_len tokens
            ok = rng.random((requests, B - 1)) < p
            run_len = np.where(ok.all(axis=1), B - 1, ok.argmin(axis=1))
            drafted = None
            if d.draft_full:
                block = pos[:, None] + np.arange(1, B, dtype=np.int64)[None, :]
                block[np.arange(B - 1)[None, :] >= run_len[:, None]] += 10**9
                drafted = Host(block)
            acc = np.minimum(run_len, b - 1)
            committed = np.zeros((requests, b), dtype=np.int64)
            for i in range(requests):
                committed[i, : acc[i] + 1] = np.arange(pos[i] + 1, pos[i] + 2 + acc[i])
            loop.launched(LaunchedStep(rids, d, drafted, Host(committed)))
            loop.complete(acc.tolist(), requests)
            pos += acc + 1
            t = t1 if b == 1 and not d.draft_full else (t_probe if b == 1 else t_wide + t_per_width * b)
            now += t * (float(rng.lognormal(0.0, noise)) if noise > 0 else 1.0)
            log.append((b, d.draft_full))
    return log


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=40)
    p.add_argument("--steps", type=int, default=500, help="steps per phase")
    p.add_argument("--low", type=float, default=0.2, help="per-position acceptance of the first phase")
    p.add_argument("--high", type=float, default=0.9, help="per-position acceptance of the second phase")
    p.add_argument("--t1", type=float, default=0.009)
    p.add_argument("--t-probe", type=float, default=0.013)
    p.add_argument("--t-wide", type=float, default=0.017)
    p.add_argument("--t-per-width", type=float, default=0.0002, help="a drafted width b costs t-wide + b x this")
    p.add_argument("--requests", type=int, default=1, help="requests in the batch (all with the phase's acceptance)")
    p.add_argument("--noise", type=float, default=0.0, help="lognormal sigma of every step time (0: exact)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/probe_schedule.json")
    a = p.parse_args(argv)
    rows = {}
    for name, overrides in CONFIGS.items():
        cfg = ControllerConfig(**overrides)
        rates, on = [], []
        for seed in range(a.seeds):
            log = run(cfg, [a.low, a.high], a.steps, np.random.default_rng(seed),
                      (a.t1, a.t_probe, a.t_wide, a.t_per_width), a.requests, a.noise)
            low, high = log[100: a.steps], log[a.steps:]
            width1 = [x for x in low if x[0] == 1]
            rates.append(sum(1 for x in width1 if x[1]) / max(1, len(width1)))
            on.append(next((i for i, x in enumerate(high) if x[0] > 1), len(high)))
        rows[name] = {"probe_rate": float(np.mean(rates)), "turn_on_mean": float(np.mean(on)),
                      "turn_on_p90": float(np.percentile(on, 90))}
    print(f"| configuration ({a.requests} request(s), acceptance {a.low} -> {a.high}, {a.seeds} seeds) | "
          f"probe rate at width 1 "
          f"| turn-on steps, mean | p90 |\n|---|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['probe_rate']:.3f} | {r['turn_on_mean']:.1f} | {r['turn_on_p90']:.0f} |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
