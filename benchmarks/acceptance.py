"""Acceptance length and speedup of the bundled pair, through real servers on CPU.

Greedy decoding of held-out prompts (stdlib files the models never trained on: code prefixes and
chat prompts) at concurrency 1, first on a plain server, then on a DFlash server (one server at
a time). Acceptance length = completion tokens / verify steps, summed over requests (SGLang's
per-request `spec_accept_length` is the same ratio per request; the prefill's first token counts
as in SGLang). Speedup = DFlash output tokens/s over plain output tokens/s, end to end per
request (prefill included). Outputs are also compared token for token (greedy is lossless).
Prints a markdown table and writes JSON.

    python benchmarks/acceptance.py [--config deploy/configs/cpu.yaml] [--prompts 24] [--max-new 128]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.step_time import server_config as _step_time_config  # noqa: E402
from harness.server import ManagedServer  # noqa: E402


def server_config(base: Path, speculative: bool) -> dict:
    cfg = _step_time_config(base, speculative)
    cfg["sglang_args"].pop("disable_radix_cache", None)  # the default config as users run it
    return cfg


def held_out_prompts(tokenizer, n: int, seed: int) -> list[tuple[str, list[int]]]:
    from dflash_models import corpus, data

    split = corpus.split_files(corpus.stdlib_files())
    out = []
    for p in data.prompts(split.heldout, n, seed):
        out.append((p.kind, tokenizer(p.text, add_special_tokens=False)["input_ids"][-256:]))
    return out


def run_server(server: ManagedServer, prompts, max_new: int, speculative: bool) -> list[dict]:
    server.generate(prompts[0][1], max_new_tokens=8, temperature=0)  # warm-up
    rows = []
    for i, (kind, ids) in enumerate(prompts):
        t = time.perf_counter()
        r = server.generate(ids, max_new_tokens=max_new, temperature=0, ignore_eos=False)
        dt = time.perf_counter() - t
        meta = r["meta_info"]
        rows.append({"kind": kind, "seconds": dt, "tokens": meta["completion_tokens"], "output_ids": r["output_ids"],
                     "verify": meta.get("spec_verify_ct", 0) if speculative else meta["completion_tokens"]})
        print(f"[bench] {'dflash' if speculative else 'plain'} {i + 1}/{len(prompts)} ({kind}): "
              f"{meta['completion_tokens']} tokens in {dt:.2f}s"
              + (f", accept {meta.get('spec_accept_length', 0):.2f}" if speculative else ""), file=sys.stderr, flush=True)
    return rows


def summarize(plain: list[dict], spec: list[dict], kinds) -> dict:
    sel_p = [r for r in plain if r["kind"] in kinds]
    sel_s = [r for r in spec if r["kind"] in kinds]
    tok = sum(r["tokens"] for r in sel_s)
    plain_tps = sum(r["tokens"] for r in sel_p) / sum(r["seconds"] for r in sel_p)
    spec_tps = tok / sum(r["seconds"] for r in sel_s)
    return {"requests": len(sel_s), "new_tokens": tok, "plain_tok_s": plain_tps, "dflash_tok_s": spec_tps,
            "speedup": spec_tps / plain_tps, "accept_length": tok / max(1, sum(r["verify"] for r in sel_s)),
            "accept_length_median_request": statistics.median(r["tokens"] / max(1, r["verify"]) for r in sel_s),
            "plain_ms_per_token": 1000 / plain_tps, "dflash_ms_per_token": 1000 / spec_tps}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=REPO / "deploy/configs/cpu.yaml")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/acceptance_cpu.json")
    a = p.parse_args(argv)

    from transformers import AutoTokenizer

    cfg = server_config(a.config, True)
    target, drafter = Path(cfg["model"]["path"]), Path(cfg["speculative"]["draft_model_path"])
    block = cfg["speculative"].get("block_size") or json.loads((drafter / "config.json").read_text())["block_size"]
    prompts = held_out_prompts(AutoTokenizer.from_pretrained(str(target)), a.prompts, a.seed)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, speculative in (("plain", False), ("dflash", True)):
            print(f"[bench] starting {label} server", file=sys.stderr, flush=True)
            with ManagedServer(server_config(a.config, speculative), Path(tmp), label) as server:
                runs[label] = run_server(server, prompts, a.max_new, speculative)

    mismatches = sum(x["output_ids"] != y["output_ids"] for x, y in zip(runs["plain"], runs["dflash"]))
    groups = {"all": ("code", "chat"), "code": ("code",), "chat": ("chat",)}
    summary = {g: summarize(runs["plain"], runs["dflash"], k) for g, k in groups.items()
               if any(r["kind"] in k for r in runs["plain"])}
    rows = [f"| prompts | requests | new tokens | plain tok/s | DFlash tok/s | speedup | acceptance length (block {block}) |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for g, s in summary.items():
        rows.append(f"| {g} | {s['requests']} | {s['new_tokens']} | {s['plain_tok_s']:.1f} | {s['dflash_tok_s']:.1f} "
                    f"| {s['speedup']:.2f}x | {s['accept_length']:.2f} |")
    table = "\n".join(rows)
    print(table)
    print(f"greedy outputs differing between plain and DFlash: {mismatches}/{len(prompts)}")
    threads = cfg.get("server", {}).get("cpu_threads", "auto")
    result = {"config": str(a.config.relative_to(REPO) if a.config.is_relative_to(REPO) else a.config),
              "target": str(target.relative_to(REPO) if target.is_relative_to(REPO) else target),
              "drafter": str(drafter.relative_to(REPO) if drafter.is_relative_to(REPO) else drafter),
              "block_size": block, "n_prompts": len(prompts), "max_new_tokens": a.max_new, "seed": a.seed,
              "concurrency": 1, "threads": threads, "greedy_mismatches": mismatches, "summary": summary,
              "table": table,
              "requests": {k: [{kk: vv for kk, vv in r.items() if kk != "output_ids"} for r in v]
                           for k, v in runs.items()}}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
