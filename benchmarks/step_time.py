"""Decode step time on CPU: plain decoding vs DFlash (block 16), through real servers.

For each (context, concurrency) the same random prompts go to both servers twice: once for
1 new token (prefill only) and once for N. step = (t_N - t_1) / decode steps, where decode
steps = N - 1 for plain decoding and the request's verify count for DFlash (its first token
also comes from prefill). Radix caching is off so both calls prefill. Each point is the
median of --repeats. Prints a markdown table and writes JSON.

    python benchmarks/step_time.py [--contexts 128 512 1024] [--concurrency 1 8]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.server import ManagedServer  # noqa: E402


def server_config(base: Path, speculative: bool) -> dict:
    cfg = yaml.safe_load(base.read_text())
    for section, key in (("model", "path"), ("speculative", "draft_model_path")):
        p = Path(cfg[section][key])
        cfg[section][key] = str(p if p.is_absolute() else (base.parent / p).resolve())
    if not speculative:
        cfg["speculative"] = {"algorithm": "none"}
    cfg.setdefault("sglang_args", {})["disable_radix_cache"] = True
    return cfg


def prompts(vocab: int, context: int, n: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(16, vocab) for _ in range(context)] for _ in range(n)]


def timed(server: ManagedServer, ids, new_tokens: int, temperature: float = 0.0) -> tuple[float, list[dict]]:
    t = time.perf_counter()
    out = server.generate(ids, max_new_tokens=new_tokens, temperature=temperature)
    return time.perf_counter() - t, out


def measure(server: ManagedServer, ids, new_tokens: int, repeats: int, speculative: bool,
            temperature: float = 0.0) -> dict:
    steps_ms, first_ms, accept = [], [], []
    for _ in range(repeats):
        t1, _ = timed(server, ids, 1, temperature)
        tn, out = timed(server, ids, new_tokens, temperature)
        steps = max(o["meta_info"].get("spec_verify_ct", 0) for o in out) if speculative else new_tokens - 1
        steps_ms.append(1000 * (tn - t1) / steps)
        first_ms.append(1000 * t1)
        if speculative:
            accept.append(statistics.mean(o["meta_info"]["spec_accept_length"] for o in out))
    # first_token_ms: the whole batch's prompts prefilled and one token each answered (the batch's TTFT)
    res = {"step_ms": statistics.median(steps_ms), "step_ms_all": steps_ms,
           "first_token_ms": statistics.median(first_ms)}
    if speculative:
        res["accept_length"] = statistics.mean(accept)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=REPO / "deploy/configs/cpu.yaml")
    p.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/step_time_cpu.json")
    a = p.parse_args(argv)

    vocab = json.loads((Path(server_config(a.config, True)["model"]["path"]) / "config.json").read_text())["vocab_size"]
    points = [(c, n) for c in a.contexts for n in a.concurrency]
    results = {f"{c}x{n}": {"context": c, "concurrency": n} for c, n in points}
    with tempfile.TemporaryDirectory() as tmp:
        for label, spec in (("plain", False), ("dflash", True)):
            print(f"[bench] starting {label} server", file=sys.stderr, flush=True)
            with ManagedServer(server_config(a.config, spec), Path(tmp), label) as server:
                timed(server, prompts(vocab, 64, 1, 0), 8)  # warm-up
                for i, (c, n) in enumerate(points):
                    r = measure(server, prompts(vocab, c, n, seed=c * 100 + n), a.new_tokens, a.repeats, spec)
                    results[f"{c}x{n}"][label] = r
                    print(f"[bench] {label} {i + 1}/{len(points)}: context {c}, concurrency {n}: "
                          f"{r['step_ms']:.1f} ms/step", file=sys.stderr, flush=True)

    rows = ["| context | concurrency | plain step (ms) | DFlash step, block 16 (ms) | ratio | DFlash accept length |",
            "|---:|---:|---:|---:|---:|---:|"]
    for r in results.values():
        r["ratio"] = r["dflash"]["step_ms"] / r["plain"]["step_ms"]
        rows.append(f"| {r['context']} | {r['concurrency']} | {r['plain']['step_ms']:.1f} | {r['dflash']['step_ms']:.1f} "
                    f"| {r['ratio']:.2f} | {r['dflash']['accept_length']:.2f} |")
    print("\n".join(rows))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"new_tokens": a.new_tokens, "repeats": a.repeats, "points": list(results.values())},
                                indent=2) + "\n")
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
