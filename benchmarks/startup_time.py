"""Start-up and stop time of `dflash-serve serve` with the embedded default config (deploy/configs/cpu.yaml).

Usage (from anywhere; the repo root is found from this file):
    python benchmarks/startup_time.py [--repeats 3] [--before DIR]

Each run spawns the launcher and reads its log as it grows: when each start-up phase first appears (seconds since
spawn), when /health first answers 200, and how long SIGTERM takes to end the launcher (idle server). `--before DIR`
also runs the same config from another checkout (its PYTHONPATH; run from outside the repo so the current
directory does not shadow it), alternating with this one: this machine drifts, so the two are compared turn by turn.
Prints a table of medians and writes JSON (default benchmarks/results/startup_time_cpu.json).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.acceptance import server_config  # noqa: E402  (the default config as users run it)
from harness.server import ManagedServer  # noqa: E402

# (column, the log line that marks it); the first is the launcher handing over to SGLang
MARKS = (
    ("launcher done", "dflash-serve: starting"),
    ("SGLang main imported", "Cuda graph is disabled"),
    ("scheduler imported", "Init parallel begin"),
    ("weights loaded", "Load weight end"),
    ("HTTP up", "Uvicorn running"),
    ("warm-up done", "fired up"),
)


def one_run(workdir: Path, name: str, env: dict[str, str] | None) -> dict[str, float]:
    server = ManagedServer(server_config(ROOT / "deploy/configs/cpu.yaml", speculative=True), workdir, name,
                           env=env)
    t0 = time.monotonic()
    server.spawn()
    out: dict[str, float] = {}
    try:
        while server.proc.poll() is None and "warm-up done" not in out:
            text = server.log_path.read_text(errors="replace")
            for column, marker in MARKS:
                if column not in out and marker in text:
                    out[column] = time.monotonic() - t0
            time.sleep(0.05)
        server.wait_ready()
        out["healthy"] = time.monotonic() - t0
    finally:
        t1 = time.monotonic()
        status = server.stop()
        out["stop (SIGTERM to exit)"] = time.monotonic() - t1
    if status not in (0, None):
        raise RuntimeError(f"{name}: the launcher exited with {status}:\n{server.log_tail()}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--before", type=Path, default=None, metavar="DIR", help="also run this checkout, alternating")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/startup_time_cpu.json")
    a = p.parse_args(argv)
    variants = {"this checkout": None}
    if a.before is not None:
        variants["before"] = {"PYTHONPATH": str(a.before.resolve())}
    runs: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeats):
            for v, env in variants.items():
                r = one_run(Path(tmp), f"{v.replace(' ', '-')}-{i}", env)
                runs[v].append(r)
                print(f"[startup] {v} run {i + 1}/{a.repeats}: healthy {r['healthy']:.1f} s, stop "
                      f"{r['stop (SIGTERM to exit)']:.1f} s", file=sys.stderr, flush=True)
    columns = [c for c, _ in MARKS] + ["healthy", "stop (SIGTERM to exit)"]
    medians = {v: {c: statistics.median(r[c] for r in rs if c in r) for c in columns if any(c in r for r in rs)}
               for v, rs in runs.items()}
    print(f"seconds since spawn, median of {a.repeats}")
    print("| variant | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for v, m in medians.items():
        print(f"| {v} | " + " | ".join(f"{m[c]:.1f}" if c in m else "--" for c in columns) + " |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"machine": platform.platform(), "cpus": os.cpu_count(), "repeats": a.repeats,
                                 "before": str(a.before) if a.before else None, "medians": medians, "runs": runs},
                                indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
