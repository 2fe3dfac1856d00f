"""Where the scheduler's time goes per output token under chat traffic: arrivals, prefills and finishes included.

benchmarks/step_profile.py splits one steady decode step (a fixed batch, no arrivals). A sweep point has more:
requests arrive (prefill, a draft-KV fill of the prompt, the controller's batch change) and finish (the deferred
draft-KV append flushed, the counters written). This runs the sweep's own workloads (loadtest/configs.yaml
`workloads:`: prompts and temperature) as a closed loop of N streaming chat users against every configuration's
server, in turns, while `py-spy record` samples the scheduler; each sample is charged to a phase as step_profile
charges it. A phase's cost is its busy seconds over the output tokens generated in the same window (each
finished request's `usage.completion_tokens` spread over its decode time): ms per output token, comparable
across configurations that commit different tokens per step. The target forward per token is the same work in
every configuration; the rest is what a configuration adds or saves.

    python benchmarks/load_profile.py [--workloads prose code] [--users 4] [--seconds 20] [--rounds 2]

Prints one markdown table per workload and users, writes JSON. Needs py-spy and ptrace rights.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.step_profile import PHASE_NAMES, config_for, parse_raw, phase_table, record_scheduler  # noqa: E402
from harness.server import ManagedServer  # noqa: E402
from loadtest.dataset import load_requests  # noqa: E402

CONFIGS = ("no-spec", "adaptive")  # step_profile.CONFIGS names


def workloads(names: list[str]) -> dict[str, tuple[list, float]]:
    """name -> ([(messages, temperature)], the workload's temperature), from the sweep's configurations file: a
    line's own temperature wins over the workload's, as the sweep sends it."""
    path = REPO / "loadtest/configs.yaml"
    raw = yaml.safe_load(path.read_text())["workloads"]
    out = {}
    for n in names:
        temp = float(raw[n].get("temperature", 0))
        reqs = load_requests((path.parent / raw[n]["dataset"]).resolve())
        chats = [(r.messages, temp if r.temperature is None else float(r.temperature))
                 for r in reqs if r.messages is not None]
        if len(chats) != len(reqs):
            raise SystemExit(f"workload {n}: completion prompts; this tool sends chats only")
        out[n] = (chats, temp)
    return out


def chat_users(url: str, users: int, convs: list, max_tokens: int, stop: threading.Event, done: list):
    """Start `users` closed-loop streaming chat clients (the openai client, as loadtest/chat.py's users send) over
    `convs`, (messages, temperature) pairs; each finished request appends (first chunk time, end time, completion
    tokens) to `done`."""
    from openai import OpenAI

    def user(seed: int) -> None:
        client = OpenAI(base_url=url + "/v1", api_key="none")
        model = client.models.list().data[0].id
        rnd = random.Random(seed)
        while not stop.is_set():
            first, tokens = None, 0
            messages, temperature = rnd.choice(convs)
            for chunk in client.chat.completions.create(
                    model=model, messages=messages, max_tokens=max_tokens, temperature=temperature,
                    stream=True, stream_options={"include_usage": True}):
                if first is None and chunk.choices:
                    first = time.perf_counter()
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            if first is not None:
                done.append((first, time.perf_counter(), tokens))

    threads = [threading.Thread(target=user, args=(i,), daemon=True) for i in range(users)]
    for t in threads:
        t.start()
    return threads


def point(server: ManagedServer, users: int, convs: list, max_tokens: int, seconds: float,
          rate: int, keep: Path | None) -> tuple[Counter, float]:
    """(py-spy samples by phase, output tokens generated) over `seconds` of steady load."""
    stop, done = threading.Event(), []
    threads = chat_users(server.url, users, convs, max_tokens, stop, done)
    time.sleep(3.0)  # every user past its first prefill
    t0 = time.perf_counter()
    text = record_scheduler(server, seconds, rate, keep)
    t1 = time.perf_counter()
    stop.set()
    for t in threads:
        t.join()
    return parse_raw(text), tokens_in(done, t0, t1)


def tokens_in(done: list[tuple[float, float, int]], t0: float, t1: float) -> float:
    """Output tokens generated in [t0, t1]: each request's tokens spread evenly over its decode time (first chunk
    to end), so requests that straddle the window count for their share. (SGLang's token counter is published
    every few dozen steps: over seconds it moves in steps of a thousand tokens.)"""
    out = 0.0
    for first, end, tokens in done:
        span = max(end - first, 1e-9)
        out += tokens * max(0.0, min(end, t1) - max(first, t0)) / span
    return out


def table(title: str, rows: dict[str, dict]) -> str:
    return phase_table(f"#### {title}: scheduler ms per output token by phase", "ms / token", "tokens/s",
                       {name: (r["ms_per_token"], f"{r['tokens_per_s']:.0f}", r["phase_ms_per_token"])
                        for name, r in rows.items()}, digits=3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=REPO / "deploy/configs/cpu.yaml", help="base server config")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), help="step_profile.py configuration names")
    p.add_argument("--workloads", nargs="+", default=["prose"], help="loadtest/configs.yaml workloads")
    p.add_argument("--users", type=int, nargs="+", default=[4])
    p.add_argument("--max-tokens", type=int, default=128, help="as the sweep's default")
    p.add_argument("--seconds", type=float, default=20, help="py-spy recording per point and round")
    p.add_argument("--rounds", type=int, default=2, help="turns over the configurations (samples summed)")
    p.add_argument("--rate", type=int, default=400, help="py-spy samples per second")
    p.add_argument("--before", type=Path, default=None, metavar="DIR",
                   help="also run the adaptive configuration from this checkout (NAME@before), side by side")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/load_profile_cpu.json")
    p.add_argument("--raw-dir", type=Path, default=None, help="keep py-spy's raw stacks here")
    a = p.parse_args(argv)
    if shutil.which("py-spy") is None:
        p.error("py-spy is not installed: pip install py-spy")
    wls = workloads(a.workloads)
    names = list(a.configs) + ([f"{n}@before" for n in a.configs if n != "no-spec"] if a.before else [])
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        servers = {}
        for name in names:  # every server up at once, measured in turns: this machine drifts over minutes
            base = name.removesuffix("@before")
            before = a.before.resolve() if name.endswith("@before") else None
            servers[name] = stack.enter_context(ManagedServer(
                config_for(a.config, base), Path(tmp), name.replace("@", "-"),
                env=None if before is None else {"PYTHONPATH": str(before)}, cwd=before))
        for wl, (convs, temp) in wls.items():
            for users in a.users:
                acc = {name: (Counter(), 0.0) for name in servers}
                for rnd in range(a.rounds):
                    for name, server in servers.items():
                        keep = a.raw_dir / f"{wl}_u{users}_{name}_{rnd}.txt" if a.raw_dir else None
                        samples, tokens = point(server, users, convs, a.max_tokens, a.seconds, a.rate, keep)
                        acc[name][0].update(samples)
                        acc[name] = (acc[name][0], acc[name][1] + tokens)
                        print(f"[load-profile] {wl}, {users} users, {name}, round {rnd + 1}: {tokens:.0f} tokens",
                              file=sys.stderr, flush=True)
                rows = {}
                for name, (samples, tokens) in acc.items():
                    per = 1000.0 / a.rate / max(tokens, 1.0)  # ms of busy time per sample, per output token
                    rows[name] = {"tokens": tokens, "samples": dict(samples),
                                  "tokens_per_s": tokens / (a.seconds * a.rounds),
                                  "ms_per_token": per * sum(samples.values()),
                                  "phase_ms_per_token": {ph: per * samples.get(ph, 0) for ph in PHASE_NAMES}}
                results[f"{wl}/u{users}"] = {"workload": wl, "users": users, "temperature": temp, "configs": rows}
                print(table(f"{wl} (temperature {temp:g}), {users} users", rows) + "\n")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"seconds": a.seconds, "rounds": a.rounds, "rate": a.rate,
                                 "max_tokens": a.max_tokens, "phases": PHASE_NAMES, "points": results},
                                indent=2) + "\n")
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
