"""Would a verify width per request beat one width per batch? An upper bound from true acceptance curves.

dflash_adaptive verifies one width b for the whole batch unless ``per_request_widths`` is on; a ragged verify -- b_r
per request -- lets a request the drafter cannot guess verify 1 while the others verify 16. This estimated what that
could gain, before it was built (the controller's own assignment is sglang_ext/controller/ragged.py, priced on the
cost row at the mean width rather than on this fitted line):

  * batches of ``bs`` requests drawn from a traffic mix of the simulator's acceptance families (harness/workload.py:
    true per-request curves, E_r(b) = 1 + sum_{j<b} prod_{i<=j} p_ri);
  * step cost from a measured table T(bs, b) (default: the CPU server's own, learned online on the code mix,
    benchmarks/results/cost_table_cpu_code16.json), fitted per batch size as T = a + d [any drafted] + c * mean(b_r)
    -- what a ragged verify would cost if its cost grows with the tokens verified as the table's does with b;
  * batch-wide: max_b sum_r E_r(b) / T(bs, b) (the oracle of what dflash_adaptive runs, true acceptance known);
    per-request: the best assignment b_r (Dinkelbach iteration on the ratio: each request takes
    argmax_b E_r(b) - lambda * c * b / bs), no better than the batch-wide choice by construction.
The ratio per-request / batch-wide is an upper bound on the gain (perfect knowledge, ragged cost linear, no
implementation overhead). Batches are drawn uniformly from the mix; in a busy server low-acceptance requests stay
longer, so they are over-represented in real batches and the gain would be somewhat larger.

    python benchmarks/per_request_widths.py [--mix code:0.71,math:0.145,prose:0.145] [--batches 4,8,16,32]

Prints a table and writes JSON (benchmarks/results/per_request_widths.json).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from harness.workload import FAMILIES, request_curves  # noqa: E402
from sglang_ext.controller.cost_model import CostModel  # noqa: E402

CANDIDATES = np.array([1, 2, 4, 8, 16])


def parse_mix(text: str) -> dict[str, float]:
    out = {}
    for part in text.split(","):
        name, _, w = part.partition(":")
        if name not in FAMILIES:
            raise SystemExit(f"--mix: unknown family {name!r} (known: {', '.join(FAMILIES)})")
        out[name] = float(w or 1.0)
    return out


def pool(mix: dict[str, float], n: int, seed: int) -> np.ndarray:
    """[n, candidates] E_r(b) for requests drawn from the mix by weight."""
    rng = np.random.default_rng(seed)
    names, weights = list(mix), np.array(list(mix.values()))
    counts = rng.multinomial(n, weights / weights.sum())
    parts = [request_curves(FAMILIES[f], 15, CANDIDATES, n=max(k, 1), seed=seed + i)["high"][:k]
             for i, (f, k) in enumerate(zip(names, counts))]
    return np.concatenate(parts)


def fit(row: np.ndarray) -> tuple[float, float, float]:
    """T(b) = a + d [b > 1] + c * b: the drafted widths' line (c, a + d) and width 1's point."""
    c, ad = np.polyfit(CANDIDATES[1:].astype(float), row[1:], 1)
    c = max(float(c), 0.0)
    a = float(row[0]) - c
    return a, max(float(ad) - a, 0.0), c  # a drafted step is never cheaper than width 1


def per_request(E: np.ndarray, a: float, d: float, c: float, lam: float) -> float:
    """Best ragged goodput of one batch (E: [bs, candidates]) by Dinkelbach iteration from ``lam``."""
    bs = E.shape[0]
    best = lam
    for _ in range(20):
        pick = np.argmax(E - lam * c * CANDIDATES[None, :] / bs, axis=1)
        b = CANDIDATES[pick]
        t = a + (d if (b > 1).any() else 0.0) + c * b.mean()
        g = float(E[np.arange(bs), pick].sum()) / t
        best = max(best, g)
        if abs(g - lam) <= 1e-9 * g:
            break
        lam = g
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mix", default="code:0.71,math:0.145,prose:0.145",
                   help="families:weights (default: loadtest's code mix -- 44 code, 9 math, 9 chat prompts -- with "
                        "the chat prompts accepting like prose under the bundled code drafter)")
    p.add_argument("--cost", type=Path, default=REPO / "benchmarks/results/cost_table_cpu_code16.json",
                   help="cost table JSON (batch_buckets, block_sizes, seconds), or 'h200' for the packaged roofline")
    p.add_argument("--batches", default="2,4,8,16,32")
    p.add_argument("--draws", type=int, default=2000, help="batches drawn per batch size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/per_request_widths.json")
    a = p.parse_args(argv)
    mix = parse_mix(a.mix)
    cands = [int(b) for b in CANDIDATES]
    cost = (CostModel.default(cands) if str(a.cost) == "h200"
            else CostModel.from_profile(json.loads(a.cost.read_text()), cands))
    E_pool = pool(mix, 8000, a.seed)
    rng = np.random.default_rng(a.seed + 1)
    rows = []
    for bs in (int(x) for x in a.batches.split(",")):
        row = np.asarray(cost.row(bs), dtype=float)
        lin_a, lin_d, lin_c = fit(row)
        ratios, widths, mixed = [], [], 0
        for _ in range(a.draws):
            E = E_pool[rng.integers(0, len(E_pool), bs)]
            g = E.sum(axis=0) / row
            k = int(g.argmax())
            pr = per_request(E, lin_a, lin_d, lin_c, float(g[k]))
            ratios.append(pr / float(g[k]))
            widths.append(cands[k])
            pick = np.argmax(E - pr * lin_c * CANDIDATES[None, :] / bs, axis=1)
            mixed += int(len(set(pick.tolist())) > 1)
        r = np.asarray(ratios)
        rows.append({"batch": bs, "mean_gain": float(r.mean()), "p90_gain": float(np.quantile(r, 0.9)),
                     "share_batches_gaining_3pct": float((r >= 1.03).mean()),
                     "share_batches_mixed_widths": mixed / a.draws,
                     "batch_wide_width_share": {b: widths.count(b) / len(widths) for b in cands if b in widths},
                     "fit_ms": {"a": 1e3 * lin_a, "d": 1e3 * lin_d, "c": 1e3 * lin_c}})
    print(f"#### per-request / batch-wide goodput (upper bound), mix {a.mix}, cost {a.cost.name}")
    print("| batch | mean gain | p90 gain | batches >= 3 % | batches with mixed widths | batch-wide widths |")
    print("|---:|---:|---:|---:|---:|---|")
    for r in rows:
        share = ", ".join(f"{b}: {100 * f:.0f} %" for b, f in r["batch_wide_width_share"].items())
        print(f"| {r['batch']} | {r['mean_gain']:.3f} | {r['p90_gain']:.3f} | "
              f"{100 * r['share_batches_gaining_3pct']:.0f} % | {100 * r['share_batches_mixed_widths']:.0f} % | {share} |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "rows": rows}, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
