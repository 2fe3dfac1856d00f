"""A drafter that learns the traffic it serves, side by side: two servers of one config on a workload the bundled
pair was not trained on, one learning (`learning:` on, `dflash-serve learn loop` beside it) and one not.

The workload is real-world code from this machine's installed packages (site-packages sources: the pair was trained
on the stdlib only), code prefixes and chat prompts cut as the pair's own training prompts are, at greedy. Both
servers get the same prompt stream (fresh prompts every window, never repeated) from `--users` closed-loop users
each. Every `--window` seconds each server's acceptance length (1 + accepted / verify steps, from its /metrics) and
output tokens/s are read. After `--minutes`, both are measured on the pair's original mix (prompts from the held-out
stdlib files, greedy). The learner's promotions and refusals (its decision log) are in the JSON.

    python benchmarks/learning_ab.py [--minutes 30] [--window 60] [--users 3] [--learn-steps 60]
        [--out benchmarks/results/learning_ab_cpu.json]

Prints a markdown table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.server import ManagedServer  # noqa: E402

ADMIN_ENV, ADMIN = "DFLASH_LEARN_BENCH_ADMIN", "learn-bench-admin-key"


def site_packages_files() -> list[Path]:
    import sysconfig

    root = Path(sysconfig.get_paths()["purelib"])
    skip = {"tests", "test", "__pycache__", "sglang", "torch", "transformers"}  # huge trees; the rest is plenty
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts)
                  and 2_000 < p.stat().st_size < 200_000)[:4000]


def prompt_stream(kind: str, n: int, seed: int) -> list[str]:
    from dflash_models import corpus, data

    files = site_packages_files() if kind == "shifted" else corpus.split_files(corpus.stdlib_files()).heldout
    return [p.text for p in data.prompts(files, n, seed)]


def counters(server: ManagedServer) -> dict[str, float]:
    text = server.metrics()

    def one(name: str) -> float:
        m = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)", text, re.M)
        return float(m.group(1)) if m else 0.0

    return {"accepted": one("dflash_accepted_tokens_total"), "steps": one("dflash_verify_steps_total"),
            "tokens": one("sglang:generation_tokens_total"), "swaps": one("dflash_drafter_swaps_total")}


def run_window(servers: dict[str, ManagedServer], prompts: list[str], cursor: list[int], users: int,
               seconds: float, max_new: int) -> dict[str, dict]:
    """Both servers under the same prompts for `seconds`; per server acceptance length and tokens/s."""
    before = {k: counters(s) for k, s in servers.items()}
    stop = time.monotonic() + seconds
    lock = threading.Lock()
    failed = {k: 0 for k in servers}

    def user(name: str, server: ManagedServer, offset: int) -> None:
        k = offset
        while time.monotonic() < stop:
            with lock:  # both servers walk the same stream: server i's user j takes the same prompts
                text = prompts[(cursor[0] + k) % len(prompts)]
            k += users
            try:
                server.generate_text(text, max_new_tokens=max_new, temperature=0, ignore_eos=False)
            except Exception:  # noqa: BLE001 -- counted: a failed request across a swap is a finding
                failed[name] += 1

    t0 = time.monotonic()
    threads = [threading.Thread(target=user, args=(n, s, j)) for n, s in servers.items() for j in range(users)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    el = time.monotonic() - t0
    cursor[0] += 10_000  # fresh prompts next window
    out = {}
    for k, s in servers.items():
        a, b = before[k], counters(s)
        steps = b["steps"] - a["steps"]
        out[k] = {"acceptance": round(1 + (b["accepted"] - a["accepted"]) / steps, 3) if steps else None,
                  "tokens_per_s": round((b["tokens"] - a["tokens"]) / el, 1), "swaps": b["swaps"],
                  "failed": failed[k]}
    return out


def main(argv: list[str] | None = None) -> int:
    import yaml

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(REPO / "deploy/configs/cpu.yaml"))
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--window", type=float, default=60)
    p.add_argument("--users", type=int, default=3)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--learn-steps", type=int, default=60)
    p.add_argument("--final-seconds", type=float, default=120, help="the original-mix window at the end")
    p.add_argument("--out", default=str(REPO / "benchmarks/results/learning_ab_cpu.json"))
    a = p.parse_args(argv)

    base = Path(a.config)
    cfg = yaml.safe_load(base.read_text())
    for section, key in (("model", "path"), ("speculative", "draft_model_path")):
        q = Path(cfg[section][key])
        cfg[section][key] = str(q if q.is_absolute() else (base.parent / q).resolve())
    cfg["speculative"]["algorithm"] = "dflash_adaptive"
    cfg["server"] |= {"admin_api_key_env": ADMIN_ENV, "cpu_threads": 1, "max_running_requests": 16}
    os.environ[ADMIN_ENV] = ADMIN
    shifted = prompt_stream("shifted", 4000, seed=5)
    original = prompt_stream("original", 400, seed=6)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        learn_cfg = json.loads(json.dumps(cfg))
        learn_cfg["learning"] = {"enabled": True, "store_dir": str(tmp / "store"), "work_dir": str(tmp / "learner"),
                                 "steps": a.learn_steps, "min_sequences": 48, "interval_seconds": 1,
                                 "metrics_port": None, "threads": 1}
        env = {ADMIN_ENV: ADMIN}
        with ManagedServer(learn_cfg, tmp, "learning", env=env) as learning, \
                ManagedServer(cfg, tmp, "static", env=env) as static:
            learn_cfg["server"]["port"] = int(learning.url.rsplit(":", 1)[1])
            (tmp / "learning.yaml").write_text(yaml.safe_dump(learn_cfg))
            servers = {"learning": learning, "static": static}
            log = open(tmp / "learner.log", "w")
            learner = subprocess.Popen([sys.executable, "-m", "service.cli", "learn", "loop", "-c",
                                        str(tmp / "learning.yaml")], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
            rows, cursor, t0 = [], [0], time.monotonic()
            try:
                while time.monotonic() - t0 < 60 * a.minutes:
                    w = run_window(servers, shifted, cursor, a.users, a.window, a.max_new)
                    w["minute"] = round((time.monotonic() - t0) / 60, 1)
                    rows.append(w)
                    print(f"[{w['minute']:5.1f} min] learning {w['learning']} | static {w['static']}", flush=True)
            finally:
                learner.terminate()
                learner.wait(60)
                log.close()
            final = run_window(servers, original, [0], a.users, a.final_seconds, a.max_new)
            print(f"[original mix] learning {final['learning']} | static {final['static']}", flush=True)
            decisions_path = tmp / "learner" / "decisions.jsonl"
            decisions = [json.loads(x) for x in decisions_path.read_text().splitlines()] if decisions_path.is_file() else []
            learner_tail = (tmp / "learner.log").read_text(errors="replace").splitlines()[-40:]
    for d in decisions:
        d.pop("figures", None)
    head = rows[:2]
    tail = rows[-2:]

    def mean(rs, k, f):
        v = [r[k][f] for r in rs if r[k][f] is not None]
        return round(sum(v) / len(v), 3) if v else None

    lines = ["| minute | learning: acceptance | learning: tok/s | static: acceptance | static: tok/s | swaps |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['minute']} | {r['learning']['acceptance']} | {r['learning']['tokens_per_s']} | "
                     f"{r['static']['acceptance']} | {r['static']['tokens_per_s']} | {int(r['learning']['swaps'])} |")
    lines.append(f"| original mix (after) | {final['learning']['acceptance']} | {final['learning']['tokens_per_s']} | "
                 f"{final['static']['acceptance']} | {final['static']['tokens_per_s']} | |")
    table = "\n".join(lines)
    print(table)
    summary = {"first_windows": {"learning": mean(head, "learning", "acceptance"),
                                 "static": mean(head, "static", "acceptance")},
               "last_windows": {"learning": mean(tail, "learning", "acceptance"),
                                "static": mean(tail, "static", "acceptance")},
               "failed_requests": sum(r[k]["failed"] for r in rows for k in ("learning", "static"))}
    print(json.dumps(summary))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"args": vars(a), "windows": rows, "original_mix_after": final,
                                       "decisions": decisions, "summary": summary, "table": table,
                                       "learner_log_tail": learner_tail}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
