"""A workload switch at one user: how many steps does dflash_adaptive spend drafting after traffic turns to prose?

One fresh `dflash_adaptive` server (the CPU default pair); --code requests of the code mix (greedy) one after
another (or from --code-users concurrent users: one row for the whole phase), then --prose requests of the prose
set at temperature 1, one after another. Per request: its verify steps
by width (`dflash_block_size_steps_total` deltas) and its probes (`dflash_probe_steps_total`). A request whose
acceptance is ~1.06 tokens a step (prose here) should run width 1 from its first steps; steps at wider widths are
what the switch costs (each ~2.4x a width-1 step at 16, committing the same ~1.06 tokens).

    python benchmarks/workload_switch.py [--code 8] [--code-users 1] [--prose 10]
        [--out benchmarks/results/workload_switch_cpu.json]

Prints a markdown table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.step_time import server_config  # noqa: E402
from harness.server import ManagedServer, http_json  # noqa: E402
from loadtest import server_metrics  # noqa: E402
from loadtest.dataset import load_prompts  # noqa: E402

PROMPTS = REPO / "loadtest" / "prompts"


def _by_label(text: str, name: str, label: str) -> dict[str, float]:
    return {labels[label]: v for labels, v in server_metrics.parse(text).get(name, [])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=REPO / "deploy/configs/cpu.yaml", help="base server config")
    p.add_argument("--code", type=int, default=8, help="code requests (greedy) first")
    p.add_argument("--code-users", type=int, default=1,
                   help="concurrent users of the code phase (above 1: the phase is one row)")
    p.add_argument("--prose", type=int, default=10, help="then prose requests (temperature 1)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/workload_switch_cpu.json")
    a = p.parse_args(argv)
    cfg = server_config(a.config, speculative=True)
    cfg["speculative"] = {k: v for k, v in cfg["speculative"].items() if k != "block_size"}
    cfg["speculative"]["algorithm"] = "dflash_adaptive"
    cfg["sglang_args"]["disable_radix_cache"] = False  # as served
    code, prose = load_prompts(PROMPTS / "mix.jsonl"), load_prompts(PROMPTS / "prose.jsonl")
    plan = [("code", code[i % len(code)], 0.0) for i in range(a.code)]
    plan += [("prose", prose[i % len(prose)], 1.0) for i in range(a.prose)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp, ManagedServer(cfg, Path(tmp), "switch") as server:
        def ask(item) -> int:
            _, messages, temperature = item
            r = http_json(f"{server.url}/v1/chat/completions",
                          {"model": cfg["model"].get("served_name", "default"), "messages": messages,
                           "max_tokens": a.max_tokens, "temperature": temperature})
            return int(r["usage"]["completion_tokens"])

        together = a.code_users > 1 and a.code > 0  # the code phase as one concurrent row
        phases = [(f"code x{a.code_users} users", plan[: a.code], 0.0)] if together else []
        phases += [(item[0], [item], item[2]) for item in plan[a.code if together else 0:]]
        for kind, items, temperature in phases:
            before = server.metrics()
            with ThreadPoolExecutor(max(1, min(a.code_users, len(items)))) as pool:
                tokens = sum(pool.map(ask, items))
            after = server.metrics()
            b0, b1 = (_by_label(t, server_metrics.BLOCK_STEPS, "block_size") for t in (before, after))
            p0, p1 = (sum(_by_label(t, "dflash_probe_steps_total", "block_size").values()) for t in (before, after))
            widths = {w: int(v - b0.get(w, 0.0)) for w, v in sorted(b1.items(), key=lambda x: int(x[0]))
                      if v - b0.get(w, 0.0) > 0}
            rows.append({"workload": kind, "temperature": temperature, "requests": len(items), "tokens": tokens,
                         "steps_by_width": widths, "probes": int(p1 - p0),
                         "wide_steps": sum(n for w, n in widths.items() if int(w) > 1)})
            print(f"[switch] {kind} #{len(rows)}: {rows[-1]}", file=sys.stderr, flush=True)
    print("| # | workload | tokens | steps by width | steps wider than 1 | probes |\n|---:|---|---:|---|---:|---:|")
    for i, r in enumerate(rows, 1):
        widths = " ".join(f"{w}:{n}" for w, n in r["steps_by_width"].items())
        print(f"| {i} | {r['workload']} | {r['tokens']} | {widths} | {r['wide_steps']} | {r['probes']} |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"max_tokens": a.max_tokens, "code_users": a.code_users, "requests": rows},
                                indent=2) + "\n")
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
