"""What DDTree's per-step tensor logic costs on this machine, for a batch, at the loads and budgets the worker
serves: the marginals (tree/marginals.py: top-K of the drafter's logits and their normalisation, after the LM head
every draft pays),
tree construction, ancestor mask, accept walk and the window's reorder (sglang_ext/tree/, worker.py _marginals).

Random logits of the bundled pair's shape (15 draft positions after the anchor, its vocabulary), K = min(budget,
16) as the worker uses, one torch thread (what the CPU server runs with at server.cpu_threads auto on 2 cores).
Median of --repeats timed calls after a warm-up. The walk is timed with a target that agrees with the tree's first
child at every node (the deepest walk).

    python benchmarks/tree_cost.py [--loads 1 16 50] [--budgets 15 31 63]
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
from sglang_ext.tree.commit import window_order  # noqa: E402
from sglang_ext.tree.marginals import top_log_probs  # noqa: E402
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
    p.add_argument("--budgets", type=int, nargs="+", default=[15, 31, 63])
    p.add_argument("--topk", type=int, nargs="+", default=[16], help="K per position (capped at the budget)")
    p.add_argument("--depth", type=int, default=15)
    p.add_argument("--vocab", type=int, default=json.loads((REPO / "models/tiny-code/target/config.json").read_text())
                   ["vocab_size"])
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/tree_cost_cpu.json")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows = []
    print("| requests | budget | top-K | marginals ms | build ms | mask ms | walk ms | reorder ms | total ms |\n"
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for bs in a.loads:
        g = torch.Generator().manual_seed(bs)
        logits = torch.randn(bs, a.depth, a.vocab, generator=g) * 3
        for n in a.budgets:
            for k in sorted({min(k, n) for k in a.topk}):
                def marginals():
                    return top_log_probs(logits, k)
                values, indices = marginals()
                trees = build_trees(values, indices, n)
                # the target's choice after each node: the tree's first child there (else anything): deepest walk
                choice = torch.zeros(bs, n + 1, dtype=torch.int64)
                for i in reversed(range(n)):
                    rows_, par = torch.arange(bs), trees.parent[:, i] + 1
                    choice[rows_, par] = trees.token[:, i]
                mask = ancestor_mask(trees.parent)
                _, path, _ = walk(trees, choice, depth=a.depth, mask=mask)
                r = {"requests": bs, "budget": n, "topk": k,
                     "marginals_ms": timed(marginals, a.repeats),
                     "build_ms": timed(lambda: build_trees(values, indices, n), a.repeats),
                     "mask_ms": timed(lambda: ancestor_mask(trees.parent), a.repeats),
                     "walk_ms": timed(lambda: walk(trees, choice, depth=a.depth, mask=mask), a.repeats),
                     "reorder_ms": timed(lambda: window_order(path, n + 1), a.repeats)}
                r["total_ms"] = sum(v for key, v in r.items() if key.endswith("_ms"))
                rows.append(r)
                print(f"| {bs} | {n} | {k} | {r['marginals_ms']:.3f} | {r['build_ms']:.3f} | {r['mask_ms']:.3f} | "
                      f"{r['walk_ms']:.3f} | {r['reorder_ms']:.3f} | {r['total_ms']:.3f} |", flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"depth": a.depth, "vocab": a.vocab, "threads": a.threads, "repeats": a.repeats,
                                 "torch": torch.__version__, "rows": rows}, indent=2) + "\n")
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
