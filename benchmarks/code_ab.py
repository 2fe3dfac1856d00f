"""Two versions of the code side by side: is a refactor free? Output tokens/s of this checkout against a git ref.

Two servers of one config, one running this checkout's code and one a ref's (a temporary git worktree, put first
on each server's PYTHONPATH), measured in alternating timed windows -- the order flips every round -- so the
machine's drift falls on both. Per workload (the code mix at greedy, prose at temperature 1) and number of users,
the median of each side's windows and their ratio.

    python benchmarks/code_ab.py --old a4418c0 [--config deploy/configs/cpu.yaml] [--algorithm dflash_adaptive]
        [--users 1 4] [--rounds 3] [--seconds 15] [--out benchmarks/results/code_ab_cpu.json]

Prints a markdown table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.step_time import server_config  # noqa: E402
from harness.server import ManagedServer, http_json  # noqa: E402
from loadtest.dataset import load_prompts  # noqa: E402

PROMPTS = REPO / "loadtest" / "prompts"
WORKLOADS = {"code": (PROMPTS / "mix.jsonl", 0.0), "prose": (PROMPTS / "prose.jsonl", 1.0)}


def window(server: ManagedServer, model: str, prompts: list, temperature: float, users: int, seconds: float,
           max_tokens: int) -> float:
    """Output tokens/s of `users` closed-loop users for `seconds` (requests that end after the window count too:
    the window is measured to the last one's end)."""
    tokens = [0] * users
    stop = time.monotonic() + seconds

    def user(i: int) -> None:
        k = i
        while time.monotonic() < stop:
            body = {"model": model, "messages": prompts[k % len(prompts)], "max_tokens": max_tokens,
                    "temperature": temperature}
            tokens[i] += http_json(f"{server.url}/v1/chat/completions", body, timeout=600)["usage"]["completion_tokens"]
            k += users

    t0 = time.monotonic()
    threads = [threading.Thread(target=user, args=(i,)) for i in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(tokens) / (time.monotonic() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True, help="git ref of the code to compare against")
    p.add_argument("--config", type=Path, default=REPO / "deploy" / "configs" / "cpu.yaml")
    p.add_argument("--algorithm", default="dflash_adaptive", help="speculative.algorithm of both servers")
    p.add_argument("--users", type=int, nargs="+", default=[1, 4])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=15.0)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "code_ab_cpu.json")
    a = p.parse_args(argv)

    cfg = server_config(a.config, speculative=True)
    cfg["speculative"]["algorithm"] = a.algorithm
    cfg["speculative"].pop("block_size", None) if a.algorithm == "dflash_adaptive" else None
    model = cfg["model"].get("served_name") or cfg["model"]["path"]
    old_rev = subprocess.run(["git", "rev-parse", "--short", a.old], cwd=REPO, check=True, capture_output=True,
                             text=True).stdout.strip()
    new_rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, check=True, capture_output=True,
                             text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        old_tree = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(old_tree), a.old], cwd=REPO, check=True)
        servers = {"old": ManagedServer(cfg, Path(tmp) / "servers", "old", env={"PYTHONPATH": str(old_tree)}),
                   "new": ManagedServer(cfg, Path(tmp) / "servers", "new", env={"PYTHONPATH": str(REPO)})}
        rows = []
        # Servers start with `python -m`, which puts their working directory first on sys.path, ahead of
        # PYTHONPATH: start them from a directory holding no code.
        os.chdir(tmp)
        try:
            for s in servers.values():
                s.spawn()
            for s in servers.values():
                s.wait_ready()
            loads = {w: (load_prompts(path), temp) for w, (path, temp) in WORKLOADS.items()}
            for s in servers.values():  # warm-up: first requests compile and fill caches
                for prompts, temp in loads.values():
                    window(s, model, prompts, temp, 2, 5.0, a.max_tokens)
            for w, (prompts, temp) in loads.items():
                for users in a.users:
                    tps: dict[str, list[float]] = {"old": [], "new": []}
                    for r in range(a.rounds):
                        for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
                            tps[name].append(window(servers[name], model, prompts, temp, users, a.seconds,
                                                    a.max_tokens))
                    ratio = statistics.median(tps["new"]) / statistics.median(tps["old"])
                    rows.append({"workload": w, "users": users, "old_tok_s": tps["old"], "new_tok_s": tps["new"],
                                 "new_over_old": ratio})
                    print(f"{w} {users} users: new/old {ratio:.3f}", flush=True)
        finally:
            for s in servers.values():
                s.stop()
            os.chdir(REPO)
            subprocess.run(["git", "worktree", "remove", "--force", str(old_tree)], cwd=REPO, check=False)

    print(f"\n| workload | users | {old_rev} tok/s (median) | {new_rev} tok/s (median) | new / old |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['workload']} | {r['users']} | {statistics.median(r['old_tok_s']):.0f} | "
              f"{statistics.median(r['new_tok_s']):.0f} | {r['new_over_old']:.3f} |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"old": old_rev, "new": new_rev, "algorithm": a.algorithm, "rounds": a.rounds,
                                 "seconds": a.seconds, "max_tokens": a.max_tokens, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
