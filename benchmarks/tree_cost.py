"""What DDTree's per-step tensor logic costs on this machine: tree construction, ancestor mask and accept walk
(sglang_ext/tree/) for a batch, at the loads and budgets the sweep runs.

Random marginals of the bundled pair's shape (15 draft positions after the anchor, vocabulary 2048), top-K per
position, one torch thread (what the CPU server runs with at server.cpu_threads auto on 2 cores). Median of
--repeats timed calls after a warm-up. The walk is timed with a target that agrees with the tree's best child at
every node (the deepest walk: D passes).

    python benchmarks/tree_cost.py [--loads 1 16 50] [--budgets 16 32 64] [--topk 8]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sglang_ext.tree.build import build_trees  # noqa: E402
from sglang_ext.tree.mask import ancestor_mask  # noqa: E402
from sglang_ext.tree.walk import walk  # noqa: E402


def timed(fn, repeats: int) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loads", type=int, nargs="+", default=[1, 16, 50])
    p.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--topk", type=int, nargs="+", default=[8], help="K per position (capped at the budget)")
    p.add_argument("--depth", type=int, default=15)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/tree_cost_cpu.json")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows = []
    print("| requests | budget | top-K | build ms | mask ms | walk ms | total ms |\n|---:|---:|---:|---:|---:|---:|---:|")
    for bs in a.loads:
        g = torch.Generator().manual_seed(bs)
        logp_full = torch.log_softmax(torch.randn(bs, a.depth, a.vocab, generator=g) * 3, dim=-1)
        for n in a.budgets:
            for k in sorted({min(k, n) for k in a.topk}):
                top = torch.topk(logp_full, k, dim=-1)
                trees = build_trees(top.values, top.indices, n)
                # the target's choice after each node: the tree's first child there (else anything): deepest walk
                choice = torch.zeros(bs, n + 1, dtype=torch.int64)
                for i in reversed(range(n)):
                    rows_, par = torch.arange(bs), trees.parent[:, i] + 1
                    choice[rows_, par] = trees.token[:, i]
                r = {"requests": bs, "budget": n, "topk": k,
                     "build_ms": timed(lambda: build_trees(top.values, top.indices, n), a.repeats),
                     "mask_ms": timed(lambda: ancestor_mask(trees.parent), a.repeats),
                     "walk_ms": timed(lambda: walk(trees, choice), a.repeats)}
                r["total_ms"] = r["build_ms"] + r["mask_ms"] + r["walk_ms"]
                rows.append(r)
                print(f"| {bs} | {n} | {k} | {r['build_ms']:.3f} | {r['mask_ms']:.3f} | {r['walk_ms']:.3f} | "
                      f"{r['total_ms']:.3f} |", flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"depth": a.depth, "vocab": a.vocab, "threads": a.threads, "repeats": a.repeats,
                                 "torch": torch.__version__, "rows": rows}, indent=2) + "\n")
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
