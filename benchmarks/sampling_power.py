"""Power of the sampling-losslessness server test against plausible wrong rules, on the bundled target itself.

tests/unit/test_sampling_power.py states the power of tests/sampling_stats.py on random synthetic targets. This
script measures it where the server test runs: the bundled target's real conditionals (transformers, fp32) after
the server test's prompt, at temperature 1 with and without the arms' truncations, width-2 verification (the
server test's `fixed_block: 2` arm) with a drafter that proposes the target's favourite with probability
`--favourite` (the bundled drafter's first-draft accuracy is 0.92 at greedy, see models/tiny-code/README.md) and
another likely token otherwise. Rules: the correct chain rejection rule, W1 (after a rejection resample from the
target row without excluding the rejected token) and W2 (after a full accept draw the bonus from the draft
position's row). Per replicate, N_PER_ARM plain samples and N_PER_ARM samples of the rule go through the test's
statistic at its ALPHA.

    python -m benchmarks.sampling_power [--replicates 200] [--favourite 0.92] [--arms temperature ...]
                                        [--out benchmarks/results/sampling_power.json]

Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from tests.integration.test_sampling_distribution import CONFIGS, PROMPT
from tests.sampling_stats import ALPHA, N_PER_ARM, homogeneity_pvalue, informative_mass

REPO = Path(__file__).resolve().parents[1]
TARGET = REPO / "models/tiny-code/target"


class Target:
    """p(. | prompt + prefix) at temperature 1 after an arm's truncation (top-k, top-p on the sorted
    unrenormalised probabilities, min_p; penalties as the server applies them: additive, then scaling)."""

    def __init__(self, sampling: dict):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(TARGET))
        self.model = AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32).eval()
        self.prompt = self.tok(PROMPT)["input_ids"]
        self.s = sampling
        self.cache: dict[tuple, np.ndarray] = {}

    def __call__(self, prefix: tuple) -> np.ndarray:
        if prefix not in self.cache:
            with torch.no_grad():
                logits = self.model(torch.tensor([self.prompt + list(prefix)])).logits[0, -1].double()
            if prefix and (self.s.get("frequency_penalty") or self.s.get("repetition_penalty")):
                counts = torch.bincount(torch.tensor(prefix), minlength=logits.numel()).double()
                logits = logits - self.s.get("frequency_penalty", 0.0) * counts
                rep, seen = self.s.get("repetition_penalty", 1.0), counts > 0
                logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
            p = torch.softmax(logits, -1)
            k = self.s.get("top_k")
            if k:
                p = torch.where(p >= torch.topk(p, k).values[-1], p, torch.zeros_like(p))
            top_p = self.s.get("top_p")
            if top_p:
                sp, idx = torch.sort(p, descending=True)
                drop = (torch.cumsum(sp, 0) - sp) > top_p
                p = p.clone()
                p[idx[drop]] = 0
            min_p = self.s.get("min_p")
            if min_p:
                p = torch.where(p >= min_p * p.max(), p, torch.zeros_like(p))
            p = (p / p.sum()).numpy()
            self.cache[prefix] = p
        return self.cache[prefix]


def draw(rng: np.random.Generator, p: np.ndarray) -> int:
    return int(rng.choice(p.size, p=p))


def drafter(target: Target, prefix: tuple, favourite: float, rng: np.random.Generator, memo: dict) -> int:
    """Deterministic per context (a greedy drafter): the favourite, else the target's second choice."""
    if prefix not in memo:
        order = np.argsort(-target(prefix))
        memo[prefix] = int(order[0] if rng.random() < favourite else order[1])
    return memo[prefix]


def speculative(target: Target, rule: str, favourite: float, rng: np.random.Generator, memo: dict) -> tuple:
    out: tuple = ()
    while len(out) < 3:
        q0, d = target(out), drafter(target, out, favourite, rng, memo)
        if rng.random() < q0[d]:  # a deterministic proposal is accepted with probability q0[d]
            out += (d,)
            if len(out) < 3:
                out += (draw(rng, q0 if rule == "w2" else target(out)),)
        else:
            residual = q0.copy()
            if rule != "w1":
                residual[d] = 0.0
            out += (draw(rng, residual / residual.sum()),)
    return out[:3]


def plain(target: Target, rng: np.random.Generator) -> tuple:
    out: tuple = ()
    while len(out) < 3:
        out += (draw(rng, target(out)),)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicates", type=int, default=200)
    ap.add_argument("--favourite", type=float, default=0.92)
    ap.add_argument("--arms", nargs="+", default=sorted(CONFIGS), choices=sorted(CONFIGS), help="arms to measure")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/sampling_power.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results, tic = {}, time.perf_counter()
    for arm in args.arms:
        target = Target(CONFIGS[arm])
        row = {}
        for rule in ("correct", "w1", "w2"):
            rng = np.random.default_rng(20261124)
            rejected, mass = 0, 0.0
            for _ in range(args.replicates):
                memo: dict = {}
                a = [plain(target, rng) for _ in range(N_PER_ARM)]
                b = [speculative(target, rule, args.favourite, rng, memo) for _ in range(N_PER_ARM)]
                rejected += homogeneity_pvalue(a, b) < ALPHA
                mass += informative_mass(a, b)
            row[rule] = {"rejected": rejected / args.replicates, "informative_mass": mass / args.replicates}
        results[arm] = row
        print(f"{arm:12s} correct {row['correct']['rejected']:.3f}  W1 {row['w1']['rejected']:.3f}  "
              f"W2 {row['w2']['rejected']:.3f}  mass {row['correct']['informative_mass']:.2f}  "
              f"({time.perf_counter() - tic:.0f} s)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"prompt": PROMPT, "n_per_arm": N_PER_ARM, "alpha": ALPHA,
                                    "replicates": args.replicates, "favourite": args.favourite,
                                    "arms": results}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
