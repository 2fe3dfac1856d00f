"""DDTree against the chain, side by side through real servers: output tokens/s, tokens per step and step time per
speculation shape, on both workloads of the sweep (the code mix at greedy, prose at temperature 1) and several loads.

Servers, all up at once (a server costs ~3 GB), measured in turns within every round so drift hits them alike:
  no-spec         plain decoding
  chain16         dflash_adaptive held at verify width 16 (`fixed` mode): the drafter's full chain
  tree16/31/63    the same held at width 17, 32 or 64: every step a tree of 16, 31 or 63 draft prefixes
  adaptive-shape  the controller picks the shape every step: chains of 1, 2, 4, 8, 16, trees of 31 and 63
                  (deploy/configs/cpu-tree.yaml's candidates)
  on demand (--configs): adaptive (chains only, the default candidates), w1 (held at width 1), fixed8;
  --before DIR adds the --adaptive configuration run from another checkout (NAME@before), in the same turns
Per point, after `--warmup` unmeasured requests per user (default 1), each round sends every server the same
`users` x `--requests` chat requests (`users` at a time, EOS
ignored, `--max-tokens` each) and times them; the point's tokens/s is the median round. Tokens per request-step
(1 + dflash_accepted_tokens_total / dflash_verify_steps_total), the mean step time (dflash_step_seconds) and the
adaptive server's share of steps per width (dflash_block_size_steps_total) are metric deltas over the point.

    python benchmarks/tree_throughput.py [--users 1 8 32] [--workloads code prose] [--out FILE]
    git worktree add /tmp/before HEAD~1 && python benchmarks/tree_throughput.py --configs no-spec fixed8 adaptive \
        --reference no-spec --adaptive adaptive --before /tmp/before      # a controller change, before/after

Prints one markdown table per workload and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.step_time import server_config  # noqa: E402
from harness.server import ManagedServer, http_json  # noqa: E402
from loadtest.dataset import load_prompts  # noqa: E402


SHAPES = [1, 2, 4, 8, 16, 32, 64]  # cpu-tree.yaml's candidates: above 16, a tree of width - 1 prefixes


def _fixed(width: int) -> dict:
    return {"algorithm": "dflash_adaptive", "adaptive": {"mode": "fixed", "candidates": sorted({16, width}),
                                                         "fixed_block": width}}


CONFIGS = {
    "no-spec": {"algorithm": "none"},
    "chain16": _fixed(16),
    "tree16": _fixed(17),
    "tree31": _fixed(32),
    "tree63": _fixed(64),
    "adaptive-shape": {"algorithm": "dflash_adaptive", "adaptive": {"candidates": SHAPES}},
    "adaptive": {"algorithm": "dflash_adaptive", "adaptive": {}},  # chains only: the default candidates
    "w1": _fixed(1),  # held at width 1: speculation off, what the adaptive server pays on prose
    "fixed8": _fixed(8),
}
ADAPTIVE = "adaptive-shape"
BEFORE = "@before"
WORKLOADS = {"code": ("prompts/mix.jsonl", 0.0), "prose": ("prompts/prose.jsonl", 1.0)}
SCRAPED = ("dflash_verify_steps_total", "dflash_accepted_tokens_total", "dflash_step_seconds_sum",
           "dflash_step_seconds_count", "dflash_tree_extra_tokens_total", "sglang:generation_tokens_total")


def scrape(server: ManagedServer) -> dict[str, float]:
    """Each SCRAPED family summed over its series, and the steps per width as "steps@<width>"."""
    out = dict.fromkeys(SCRAPED, 0.0)
    for line in server.metrics().splitlines():
        m = re.match(r"^([a-z_:]+)(\{[^}]*\})? (\S+)$", line)
        if m and m.group(1) in out:
            out[m.group(1)] += float(m.group(3))
        elif m and m.group(1) == "dflash_block_size_steps_total":
            width = re.search(r'block_size="(\d+)"', m.group(2)).group(1)
            out[f"steps@{width}"] = out.get(f"steps@{width}", 0.0) + float(m.group(3))
    return out


def chat(server: ManagedServer, messages, temperature: float, max_tokens: int) -> int:
    body = {"model": "dflash-tiny", "messages": messages, "temperature": temperature, "max_tokens": max_tokens,
            "ignore_eos": True}
    return int(http_json(f"{server.url}/v1/chat/completions", body, timeout=900)["usage"]["completion_tokens"])


def config_for(base: Path, name: str) -> dict:
    cfg = server_config(base, speculative=True)
    cfg["sglang_args"].pop("disable_radix_cache", None)  # as served: chat prompts share their template prefix
    spec = CONFIGS[name.removesuffix(BEFORE)]
    cfg["speculative"] = ({"algorithm": "none"} if spec["algorithm"] == "none"
                          else {**spec, "draft_model_path": cfg["speculative"]["draft_model_path"]})
    return cfg


def run_point(servers: dict[str, ManagedServer], prompts, users: int, requests: int, rounds: int,
              temperature: float, max_tokens: int, log, warmup: int = 0) -> dict[str, dict]:
    rates: dict[str, list[float]] = {n: [] for n in servers}
    with ThreadPoolExecutor(users) as pool:
        # unmeasured: `warmup` requests per user at this load (as the sweep's warm-up), so a point reads the
        # steady state, not the controller's first steps at a new load or the previous workload's carry-over
        batch = [prompts[-1 - i % len(prompts)] for i in range(users * warmup)]
        for server in servers.values():
            list(pool.map(lambda m: chat(server, m, temperature, max_tokens), batch))
        before = {n: scrape(s) for n, s in servers.items()}
        for r in range(rounds):
            batch = [prompts[(r * users * requests + i) % len(prompts)] for i in range(users * requests)]
            for name, server in servers.items():
                t = time.perf_counter()
                tokens = sum(pool.map(lambda m: chat(server, m, temperature, max_tokens), batch))
                rates[name].append(tokens / (time.perf_counter() - t))
                log(f"  round {r} {name}: {rates[name][-1]:.1f} tok/s")
    out = {}
    for name, server in servers.items():
        d = {k: v - before[name].get(k, 0.0) for k, v in scrape(server).items()}
        widths = {int(k[6:]): v for k, v in d.items() if k.startswith("steps@") and v > 0}
        steps = d["dflash_verify_steps_total"]
        out[name] = {
            "tokens_per_s": statistics.median(rates[name]), "rounds_tokens_per_s": rates[name],
            "tokens_per_step": 1 + d["dflash_accepted_tokens_total"] / steps if steps else 1.0,
            "step_ms": 1000 * d["dflash_step_seconds_sum"] / d["dflash_step_seconds_count"]
            if d["dflash_step_seconds_count"] else None,
            "tree_extra_per_step": d["dflash_tree_extra_tokens_total"] / steps if steps else 0.0,
            "width_share": {w: v / sum(widths.values()) for w, v in sorted(widths.items())},
        }
    return out


def table(workload: str, results: dict[int, dict[str, dict]], reference: str = "chain16",
          adaptive: str = ADAPTIVE) -> str:
    names = list(next(iter(results.values())))
    lines = [f"#### {workload}: output tokens/s (x {reference}) / tokens per request-step / mean step ms",
             "| users | " + " | ".join(names) + f" | best | {adaptive} / best | {adaptive}: steps per width |",
             "|---:|" + "---|" * (len(names) + 3)]
    for users, point in results.items():
        chain = point[reference]["tokens_per_s"]
        cells = []
        for n in names:
            p = point[n]
            step = "-" if p["step_ms"] is None else f"{p['step_ms']:.1f}"
            cells.append(f"{p['tokens_per_s']:.0f} ({p['tokens_per_s'] / chain:.2f}x) / {p['tokens_per_step']:.2f}"
                         f" / {step}")
        # the references a choosing server is held against: the single shapes (no other choosing server)
        singles = {n: point[n]["tokens_per_s"] for n in names
                   if n.removesuffix(BEFORE) not in ("adaptive", ADAPTIVE)}
        best = max(singles, key=singles.get)
        mix = ", ".join(f"{w}: {100 * f:.0f} %" for w, f in point[adaptive]["width_share"].items() if f >= 0.01)
        lines.append(f"| {users} | " + " | ".join(cells) +
                     f" | {best} | {point[adaptive]['tokens_per_s'] / singles[best]:.2f} | {mix} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=REPO / "deploy/configs/cpu.yaml", help="base server config")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--users", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests", type=int, default=2, help="requests per user per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1,
                   help="unmeasured requests per user before each point (0: the point includes the start-up)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/tree_throughput_cpu.json")
    p.add_argument("--reference", default="chain16", help="the configuration the table's ratios are to")
    p.add_argument("--adaptive", default=ADAPTIVE, help="the choosing configuration the table rates and breaks down")
    p.add_argument("--before", type=Path, default=None, metavar="DIR",
                   help="also run the --adaptive configuration from this checkout (NAME@before, its PYTHONPATH), "
                        "side by side: a change's before/after in one run")
    p.add_argument("--shapes", type=int, nargs="+", default=SHAPES,
                   help=f"adaptive-shape's candidate widths (default cpu-tree.yaml's, {SHAPES})")
    a = p.parse_args(argv)
    CONFIGS[ADAPTIVE] = {"algorithm": "dflash_adaptive", "adaptive": {"candidates": sorted(set(a.shapes))}}
    if a.reference not in a.configs or a.adaptive not in a.configs:
        p.error(f"--configs must include --reference {a.reference} and --adaptive {a.adaptive} (the table's)")
    configs = list(a.configs) + ([a.adaptive + BEFORE] if a.before is not None else [])

    def log(msg: str) -> None:
        print(f"[tree] {msg}", file=sys.stderr, flush=True)

    results: dict[str, dict[int, dict]] = {}

    def save() -> None:  # after every point: a long run interrupted keeps what it measured
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
                                     "results": results}, indent=1))

    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        servers = {}
        for i, name in enumerate(configs, 1):
            log(f"{i}/{len(configs)} starting {name}")
            env = {"PYTHONPATH": str(a.before.resolve())} if name.endswith(BEFORE) else None
            servers[name] = stack.enter_context(ManagedServer(config_for(a.config, name), Path(tmp),
                                                              name.replace("@", "_"), env=env))
        for workload in a.workloads:
            path, temperature = WORKLOADS[workload]
            prompts = load_prompts(REPO / "loadtest" / path)
            for s in servers.values():  # warm-up: first requests pay one-off costs
                chat(s, prompts[0], temperature, 16)
            results[workload] = {}
            for users in a.users:
                log(f"{workload}, {users} user(s)")
                results[workload][users] = run_point(servers, prompts, users, a.requests, a.rounds, temperature,
                                                     a.max_tokens, log, a.warmup)
                save()
            print(table(workload, results[workload], a.reference, a.adaptive), flush=True)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
