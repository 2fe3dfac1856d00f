"""Committed tokens per verify step on the support matrix's newer pairs, through real servers on CPU.

`--pair` picks the pair (built here): `random`, the random biased hybrid (Qwen3.5 text) pair of
dflash_models/family_qwen3_5.py, on the test prompts; `memorized`, that pair trained for about a minute to memorize
a few stdlib snippets (dflash_models/memorized_pair.py), on the snippets' openings; `dflash2`, the bundled target
with the bundled drafter turned DFlash2 (dflash_models/dflash2.py), on the test prompts. Each under plain decoding,
upstream `dflash`, `dflash_adaptive` fixed at the drafter's block and `dflash_adaptive` in its default mode; greedy,
one request at a time. Tokens per step = completion tokens / verify steps (plain: 1). Every output is compared with
plain decoding's. Seconds are one pass of tiny models: read them only side by side.
Prints a table and writes JSON.

    python benchmarks/hybrid_target.py [--pair random|memorized|dflash2] [--max-new 24] [--out FILE.json]
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
    p.add_argument("--pair", choices=("random", "memorized", "dflash2"), default="random")
    p.add_argument("--max-new", type=int, default=24)
    p.add_argument("--out", default=None, help="default: benchmarks/results/hybrid_target_cpu.json for the random "
                                               "pair, benchmarks/results/pair_<name>_cpu.json otherwise")
    a = p.parse_args(argv)
    out_path = a.out or str(REPO / "benchmarks/results" / ("hybrid_target_cpu.json" if a.pair == "random"
                                                           else f"pair_{a.pair}_cpu.json"))
    from transformers import AutoTokenizer

    from dflash_models import dflash2, family_qwen3_5, memorized_pair

    work = Path(tempfile.mkdtemp(prefix="hybrid-bench-"))
    if a.pair == "dflash2":
        bundled = REPO / "models/tiny-code"
        pair = {"target": bundled / "target", "drafter": dflash2.convert(bundled / "drafter", work / "dflash2")}
        block = json.loads((bundled / "drafter/config.json").read_text())["block_size"]
    else:
        spec = family_qwen3_5.Qwen35Spec()
        pair, block = family_qwen3_5.build(work / "pair", spec), spec.block_size
        if a.pair == "memorized":
            memorized_pair.build(pair["target"], pair["drafter"])
    tok = AutoTokenizer.from_pretrained(str(pair["target"]))
    ids = (memorized_pair.prompts(pair["target"])[:8] if a.pair == "memorized"
           else [tok(text)["input_ids"] for text in PROMPTS])
    servers = {n: ManagedServer(c, work, n, startup_timeout=900).spawn() for n, c in configs(pair, block).items()}
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
    Path(out_path).write_text(json.dumps({"pair": a.pair, "max_new": a.max_new, "prompts": len(ids), "block": block,
                                          "rows": rows}, indent=1) + "\n")
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
