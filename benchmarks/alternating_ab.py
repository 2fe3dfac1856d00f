"""One user, requests taken in turns by every configuration: time to first token, time per output token, tokens/s.

Why: at one user a load-test point of 25 s holds some twenty requests, and the machine's drift between points moves
a ratio by several percent. Here every server is up at once and each workload prompt is sent to every configuration
in turn (the order rotating every round), so a ratio compares the same prompts under the same conditions; medians of
per-request TTFT and TPOT, tokens/s over all requests. A server's own launch carries a bias too (two servers running
the same model forward have served it several percent apart for a whole run): with `--launches N` every server is
started N times, in a rotated order, the rounds split between launches, and the tables pool them, with each launch's
ratios beside. The JSON keeps each adaptive server's steps by width, its probes and plain steps, per workload and
launch.

    python benchmarks/alternating_ab.py                                 # prose and chat: no-spec vs adaptive
    python benchmarks/alternating_ab.py --workloads chat --rounds 60 --configs no-spec adaptive adaptive-w1
    python benchmarks/alternating_ab.py --launches 3 --rounds 60         # 20 rounds per launch of every server
    git worktree add /tmp/before HEAD~3 && python benchmarks/alternating_ab.py --before /tmp/before

`--before DIR` adds `adaptive@before`: the default adaptive server run from the checkout DIR. Configurations are
benchmarks/step_profile.py's; workloads (prompts, temperature) benchmarks/load_profile.py's. The first three
rounds warm every server up and are not counted. Prints one table per workload and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.load_profile import workloads  # noqa: E402
from benchmarks.step_profile import BEFORE, CONFIGS, config_for  # noqa: E402
from harness.server import ManagedServer  # noqa: E402
from loadtest.server_metrics import scrape, total  # noqa: E402

WARMUP_ROUNDS = 3


def one_request(client, model: str, messages: list, max_tokens: int, temperature: float) -> tuple[float, float, int]:
    """(TTFT s, end-to-end s, completion tokens) of one streamed chat completion."""
    t0 = time.perf_counter()
    first, tokens = None, 0
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                            temperature=temperature, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter() - t0
    return (end if first is None else first), end, tokens


def summarize(runs: list[tuple[float, float, int]]) -> dict:
    ttft = statistics.median(r[0] for r in runs)
    tpot = statistics.median((r[1] - r[0]) / (r[2] - 1) for r in runs if r[2] > 1)
    return {"requests": len(runs), "ttft_ms": ttft * 1e3, "tpot_ms": tpot * 1e3,
            "tokens_per_s": sum(r[2] for r in runs) / sum(r[1] for r in runs),
            "mean_tokens": statistics.mean(r[2] for r in runs)}


def with_ratios(table: dict, base_name: str) -> dict:
    """Each row's TTFT, TPOT and tokens/s as multiples of the baseline's."""
    base = table[base_name]
    for row in table.values():
        row["ttft_x"] = row["ttft_ms"] / base["ttft_ms"]
        row["tpot_x"] = row["tpot_ms"] / base["tpot_ms"]
        row["tokens_per_s_x"] = row["tokens_per_s"] / base["tokens_per_s"]
    return table


# the adaptive worker's step counters read around each workload: where its steps went
COUNTERS = ("dflash_probe_steps_total", "dflash_plain_decode_steps_total", "dflash_verify_steps_total")


def step_counts(url: str) -> dict[str, float]:
    """The server's step counters, and its steps by verify width (`w<b>`); empty for a server without them."""
    snap = scrape(url) or {}
    out = {name.removeprefix("dflash_").removesuffix("_total"): total(snap, name) or 0.0 for name in COUNTERS}
    for labels, value in snap.get("dflash_block_size_steps_total", []):
        out[f"w{labels.get('block_size')}"] = out.get(f"w{labels.get('block_size')}", 0.0) + value
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=REPO / "deploy/configs/cpu.yaml", help="base server config")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=["no-spec", "adaptive"],
                   help="the first is the baseline of the ratios")
    p.add_argument("--workloads", nargs="+", default=["prose", "chat"])
    p.add_argument("--rounds", type=int, default=40, help="prompts per workload, each sent to every configuration")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--launches", type=int, default=1,
                   help="start every server this many times (rotated order), the rounds split between launches")
    p.add_argument("--before", type=Path, default=None, metavar="DIR",
                   help="also run the default adaptive server from this checkout (adaptive@before)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/alternating_ab_cpu.json")
    args = p.parse_args(argv)
    if args.launches < 1 or args.rounds < 1:
        p.error("--launches and --rounds must be at least 1")
    from openai import OpenAI

    names = list(args.configs) + (["adaptive" + BEFORE] if args.before else [])
    wls = workloads(args.workloads)
    runs = {wl: {n: [] for n in names} for wl in wls}  # pooled over launches
    per_launch: dict = {wl: [] for wl in wls}
    steps: dict = {wl: {n: [] for n in names} for wl in wls}  # step counts by launch
    rounds = -(-args.rounds // args.launches)
    for launch in range(args.launches):
        order = names[launch % len(names):] + names[: launch % len(names)]
        with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
            servers = {}
            for name in order:
                kw = {}
                if name.endswith(BEFORE):
                    kw = {"env": {"PYTHONPATH": str(args.before)}, "cwd": args.before}
                print(f"[ab] launch {launch + 1}/{args.launches}: starting {name}", file=sys.stderr)
                cfg = config_for(args.config, name.removesuffix(BEFORE))
                servers[name] = stack.enter_context(ManagedServer(cfg, Path(tmp), f"s{names.index(name)}", **kw))
            clients = {n: OpenAI(base_url=s.url + "/v1", api_key="none") for n, s in servers.items()}
            models = {n: c.models.list().data[0].id for n, c in clients.items()}
            for wl, (convs, _) in wls.items():
                mine: dict[str, list] = {n: [] for n in names}
                counts_before = {n: step_counts(srv.url) for n, srv in servers.items()}
                rng = random.Random(1 + launch)
                for r in range(rounds + WARMUP_ROUNDS):
                    messages, temperature = rng.choice(convs)
                    for n in names[r % len(names):] + names[: r % len(names)]:
                        run = one_request(clients[n], models[n], messages, args.max_tokens, temperature)
                        if r >= WARMUP_ROUNDS:
                            mine[n].append(run)
                    if (r + 1) % 10 == 0:
                        print(f"[ab] launch {launch + 1}, {wl}: {r + 1}/{rounds + WARMUP_ROUNDS} rounds",
                              file=sys.stderr)
                for n in names:
                    runs[wl][n] += mine[n]
                for n, srv in servers.items():
                    after = step_counts(srv.url)
                    steps[wl][n].append({k: v - counts_before[n].get(k, 0.0) for k, v in after.items()})
                per_launch[wl].append(with_ratios({n: summarize(mine[n]) for n in names}, names[0]))
    results: dict = {"rounds": rounds * args.launches, "launches": args.launches, "max_tokens": args.max_tokens,
                     "workloads": {}}
    for wl in wls:
        table = with_ratios({n: summarize(runs[wl][n]) for n in names}, names[0])
        for n, row in table.items():
            row["tokens_per_s_x_by_launch"] = [t[n]["tokens_per_s_x"] for t in per_launch[wl]]
            row["tpot_x_by_launch"] = [t[n]["tpot_x"] for t in per_launch[wl]]
            row["steps_by_launch"] = steps[wl][n]
        results["workloads"][wl] = table
        print(f"\n#### {wl}, one user, {rounds * args.launches} prompts in turns, {args.launches} launch(es) "
              f"(x {names[0]})\n")
        print("| config | TTFT p50 ms | x | TPOT p50 ms | x | tokens/s | x | x by launch |")
        print("|---|---:|---:|---:|---:|---:|---:|---|")
        for n, row in table.items():
            spread = " ".join(f"{x:.3f}" for x in row["tokens_per_s_x_by_launch"])
            print(f"| {n} | {row['ttft_ms']:.1f} | {row['ttft_x']:.3f} | {row['tpot_ms']:.2f} | "
                  f"{row['tpot_x']:.3f} | {row['tokens_per_s']:.1f} | {row['tokens_per_s_x']:.3f} | {spread} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
