"""Committed tokens per verify step on the tiny hybrid (Qwen3.5 text) pair, through real servers on CPU.

The random biased pair of dflash_models/family_qwen3_5.py (built here in seconds) under plain decoding, upstream
`dflash`, `dflash_adaptive` fixed at the drafter's block and `dflash_adaptive` in its default mode; greedy, the test
prompts, one request at a time. Tokens per step = completion tokens / verify steps (plain: 1). Every output is
compared with plain decoding's. Seconds are one pass on a shared CPU: read them only side by side, never as a
speed claim (the pair is random; its acceptance is the bias's, not a trained drafter's).
Prints a table and writes JSON.

    python benchmarks/hybrid_target.py [--max-new 24] [--out benchmarks/results/hybrid_target_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.server import ManagedServer  # noqa: E402
from tests.conftest import PROMPTS, default_config  # noqa: E402


def configs(pair: dict, block: int) -> dict[str, dict]:
    def cfg(**spec) -> dict:
        c = default_config(pair, **spec)
        c["server"] |= {"max_total_tokens": 8192, "max_running_requests": 32}
        c["sglang_args"] = {**c.get("sglang_args", {}), "max_mamba_cache_size": 96}
        return c

    out = {"plain": cfg(algorithm="none"), "dflash": cfg(algorithm="dflash", draft_model_path=pair["drafter"])}
    for name, adaptive in {f"adaptive-fixed{block}": {"mode": "fixed", "fixed_block": block}, "adaptive": {}}.items():
        out[name] = cfg(algorithm="dflash_adaptive", draft_model_path=pair["drafter"])
        out[name]["speculative"]["adaptive"] = adaptive
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-new", type=int, default=24)
    p.add_argument("--out", default=str(REPO / "benchmarks/results/hybrid_target_cpu.json"))
    a = p.parse_args(argv)
    from transformers import AutoTokenizer

    from dflash_models import family_qwen3_5

    work = Path(tempfile.mkdtemp(prefix="hybrid-bench-"))
    spec = family_qwen3_5.Qwen35Spec()
    pair = family_qwen3_5.build(work / "pair", spec)
    tok = AutoTokenizer.from_pretrained(str(pair["target"]))
    ids = [tok(text)["input_ids"] for text in PROMPTS]
    servers = {n: ManagedServer(c, work, n, startup_timeout=900).spawn() for n, c in configs(pair, spec.block_size).items()}
    rows: dict[str, dict] = {}
    try:
        for s in servers.values():
            s.wait_ready()
        for name, s in servers.items():
            s.generate(ids[0], max_new_tokens=4, temperature=0)  # warm-up
            t0 = time.perf_counter()
            out = [s.generate(i, max_new_tokens=a.max_new, temperature=0) for i in ids]
            seconds = time.perf_counter() - t0
            tokens = sum(len(r["output_ids"]) for r in out)
            steps = sum(r["meta_info"].get("spec_verify_ct") or len(r["output_ids"]) for r in out)
            rows[name] = {"tokens": tokens, "verify_steps": steps, "tokens_per_step": tokens / steps,
                          "seconds": seconds, "outputs": [r["output_ids"] for r in out]}
    finally:
        for s in servers.values():
            s.stop()
    plain = rows["plain"]["outputs"]
    print(f"{'server':18} {'tokens':>6} {'steps':>6} {'tok/step':>8} {'seconds':>8}  same as plain")
    for name, r in rows.items():
        r["same_as_plain"] = r.pop("outputs") == plain
        print(f"{name:18} {r['tokens']:6d} {r['verify_steps']:6d} {r['tokens_per_step']:8.2f} {r['seconds']:8.2f}  "
              f"{r['same_as_plain']}")
    Path(a.out).write_text(json.dumps({"max_new": a.max_new, "prompts": len(ids), "block": spec.block_size,
                                       "rows": rows}, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
