"""Decision latency of the block-size controller (target: decide() < 100 us at batch 64).

Usage (from the repo root):  nice -n 10 python benchmarks/controller_latency.py [--calls 2000 --repeats 7]

For each batch size the controller is first warmed with 300 observed steps (hindsight on full drafted blocks,
per-request state for every request, a synced cost table), then each call is timed with time.perf_counter:
  * decide (same batch)    : the steady case, the batch did not change since the last step;
  * decide (batch changed) : the request-id -> slot lookup runs too (two batches alternate);
  * observe_step           : feeding one step's results (runs off the critical path under overlap scheduling).
Reported: median / p90 / p99 / min over calls x repeats, in microseconds. Writes benchmarks/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from sglang_ext.controller import BlockSizeController, ControllerConfig, CostModel  # noqa: E402

MAX_BLOCK = 16
J = MAX_BLOCK - 1


def _step_data(rng: np.random.Generator, bs: int, b: int, base: int) -> tuple[np.ndarray, np.ndarray, list]:
    runs = rng.integers(0, J + 1, bs)
    truth = base + np.arange(bs)[:, None] * 100 + np.arange(J + 1)[None, :]
    drafted = truth[:, :J].copy()
    drafted[np.arange(J)[None, :] >= runs[:, None]] += 10**6
    acc = np.minimum(runs, b - 1)
    committed = [truth[i, : acc[i] + 1].tolist() for i in range(bs)]
    return acc, drafted, committed


def _timed(fn, calls: int, repeats: int) -> np.ndarray:
    out = np.empty(calls * repeats)
    pc = time.perf_counter
    i = 0
    for _ in range(repeats):
        for _ in range(calls):
            t0 = pc()
            fn()
            out[i] = pc() - t0
            i += 1
    return out * 1e6


def bench(bs: int, calls: int, repeats: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    cfg = ControllerConfig()
    ctrl = BlockSizeController(cfg, CostModel.default(cfg.candidates_for(MAX_BLOCK)), MAX_BLOCK, is_rank0=True)
    ids = [f"req-{i}" for i in range(bs)]
    other = ids[1:] + ["req-x"]
    for step in range(300):
        d = ctrl.decide(ids if step % 2 else other)
        acc, drafted, committed = _step_data(rng, bs, 16, step * 10**4)
        ctrl.observe_step(ids, 16, acc, drafted, committed)
        ctrl.observe_step(["req-x"], 16, acc[:1], drafted[:1], committed[:1])
        ctrl.observe_step_time(bs, 16, 0.01, probe=d.probe)
        if ctrl.cost_sync_due:
            ctrl.sync_cost_table()
    same = _timed(lambda: ctrl.decide(ids), calls, repeats)
    flip = [ids, other]
    k = [0]

    def changed() -> None:
        k[0] ^= 1
        ctrl.decide(flip[k[0]])

    changed_t = _timed(changed, calls, repeats)
    pre = [_step_data(rng, bs, 8, 10**9 + i * 10**4) for i in range(calls)]
    j = [0]

    def observe() -> None:
        acc, drafted, committed = pre[j[0] % calls]
        j[0] += 1
        ctrl.observe_step(ids, 8, acc, drafted, committed)

    observe_t = _timed(observe, calls, max(1, repeats // 2))

    def stats(a: np.ndarray) -> dict:
        return {
            "median_us": float(np.median(a)),
            "p90_us": float(np.percentile(a, 90)),
            "p99_us": float(np.percentile(a, 99)),
            "min_us": float(a.min()),
            "mean_us": float(a.mean()),
            "samples": int(a.size),
        }

    return {
        "batch": bs,
        "decide_same_batch": stats(same),
        "decide_batch_changed": stats(changed_t),
        "observe_step": stats(observe_t),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "controller_latency.json"))
    args = ap.parse_args(argv)
    load0 = os.getloadavg()
    rows = [bench(int(b), args.calls, args.repeats) for b in args.batches.split(",") if b]
    load1 = os.getloadavg()
    print("# Controller decision latency (µs per call, time.perf_counter)\n")
    print(
        f"{args.calls} calls x {args.repeats} repeats per row (observe_step: {max(1, args.repeats // 2)} repeats); "
        f"python {platform.python_version()}, numpy {np.__version__}, {os.cpu_count()} CPUs, "
        f"load average {load0[0]:.2f} -> {load1[0]:.2f}.\n"
    )
    print("| batch | call | median | p90 | p99 | min | target |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        for key, label in (
            ("decide_same_batch", "decide (same batch)"),
            ("decide_batch_changed", "decide (batch changed)"),
            ("observe_step", "observe_step"),
        ):
            s = r[key]
            target = "< 100 µs" if (key.startswith("decide") and r["batch"] == 64) else ""
            print(
                f"| {r['batch']} | {label} | {s['median_us']:.1f} | {s['p90_us']:.1f} | {s['p99_us']:.1f} "
                f"| {s['min_us']:.1f} | {target} |"
            )
    out = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "loadavg_before": load0,
        "loadavg_after": load1,
        "calls": args.calls,
        "repeats": args.repeats,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
