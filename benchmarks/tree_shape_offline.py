"""Would choosing the tree's size every step, from that step's own draft marginals, beat a fixed shape? Offline,
on the bundled pair, greedy (where the target's path is plain decoding's output, so every shape's acceptance at every
step is known exactly).

Why: the controller picks the speculation shape (chain width or tree budget) per batch from learned acceptance and
tree gains (controller/tree_gain.py). DDTree's factorised score gives more: a step's own marginals say how likely
each prefix is, so a confident step could verify a small tree and a doubtful one a large tree. The tree target asks for
that choice "from calibrated marginals"; this measures what it would buy before the worker pays for it.

How: for every prompt of the sweep's code mix (loadtest/prompts/mix.jsonl, the target's chat template), plain
greedy decoding (EOS decoded past, as benchmarks/tree_throughput.py's servers run) gives the committed sequence. At
every step position p (anchor = the token at p, context = the target's features of positions < p, as the worker
drafts) one drafter forward yields the 15 positions' top-16 marginals; ``build_trees`` keeps the 63 best prefixes.
A node is on the accepted path iff its token is the greedy sequence's at its depth and its parent is; a tree of the
first N nodes (the N best prefixes: nodes come in score order) accepts the path's nodes below N; the chain accepts
the greedy draft's agreeing prefix. Shapes: chain 16, trees of 15, 16, 31, 63 (verify widths 16, 17, 32, 64; a
tree of 15 at the chain's own width is not a candidate the worker serves). Each policy then decodes every prompt of
the evaluation half as a server would: from the prompt's end, one step at a time, each step committing its
accepted tokens + 1 (a policy visits the positions its own steps land on: averaging over every position would
overweight the easy stretches a step skips).

Policies: each fixed shape; ``per-step``: per step the shape maximising E[tokens] - lambda x cost, E from the
step's node scores mapped through a calibration (P(on path | exp(score)), isotonic over score bins, fitted on the
first half of the prompts and evaluated on the second; lambda = the best fixed shape's tokens per ms, which makes
the rule maximise tokens / time over the steps); ``raw`` the same with exp(score) uncalibrated; ``oracle``
per step the shape that accepts most per ms, knowing the outcome (an upper bound no rule reaches).
Costs: ms per step of each shape, given (--costs: CPU at 1 request measured by benchmarks/tree_throughput.py, or
H200 estimated from benchmarks/gpu_forward_cost.py; see the README's DDTree section).

    python benchmarks/tree_shape_offline.py [--prompts 48] [--max-new 128] [--costs cpu|h200]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sglang_ext.tree.build import build_trees  # noqa: E402
from sglang_ext.tree.marginals import top_log_probs  # noqa: E402

SHAPES = ["chain16", "tree15", "tree16", "tree31", "tree63"]
NODES = {"tree15": 15, "tree16": 16, "tree31": 31, "tree63": 63}
# ms per step at one request. cpu: chain 16 and tree 31 from benchmarks/results/tree_throughput_cpu.json (code, 1
# user), tree 63 at the README's 1.57x chain; trees of 15 and 16: chain 16 + the tree step's own 0.64 ms
# (tree_cost_cpu.json) + 0.21 ms per verify token past 16 (tree 31's 22.82 ms less that, over 16 tokens).
# h200: gpu_forward_cost_h200.json's
# verify at widths 16 / 32 / 64 + its drafter (1.72 ms) + the tree step's graph (0.51 / 0.57 / 0.64 ms,
# tree_cost_h200.json): forward-only estimates.
COSTS = {"cpu": {"chain16": 18.79, "tree15": 19.43, "tree16": 19.64, "tree31": 22.82, "tree63": 29.50},
         "h200": {"chain16": 12.01, "tree15": 12.52, "tree16": 12.55, "tree31": 12.79, "tree63": 13.15}}


def load_pair():
    from safetensors.torch import load_file

    from dflash_models.drafter_model import DFlashDrafter
    from dflash_models.train_drafter import load_target

    pair = REPO / "models/tiny-code"
    cfg = json.loads((pair / "drafter/config.json").read_text())
    target = load_target(pair / "target")
    drafter = DFlashDrafter(cfg).eval()
    drafter.load_state_dict({k: v.float() for k, v in load_file(str(pair / "drafter/model.safetensors")).items()})
    return target, drafter


def greedy(target, ids: list[int], max_new: int) -> torch.Tensor:
    """Plain greedy decoding of ``max_new`` tokens, EOS included and decoded past (as the sweep's servers run with
    EOS ignored): prompt + output ids."""
    out = target(input_ids=torch.tensor([ids]), use_cache=True)
    seq = list(ids)
    for _ in range(max_new):
        nxt = int(out.logits[0, -1].argmax())
        seq.append(nxt)
        out = target(input_ids=torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
    return torch.tensor(seq)


def steps_of(target, drafter, ids: list[int], max_new: int, k: int, budget: int) -> dict[str, np.ndarray]:
    """Every step position of one prompt's greedy decoding: node scores, on-path flags, the chain's acceptance."""
    from dflash_models.train_drafter import target_features

    B = drafter.block_size
    with torch.no_grad():
        seq = greedy(target, ids, max_new)
        anchors = torch.arange(len(ids) - 1, len(seq) - B + 1)  # p: the last committed token; p + 1.. drafted
        feats = target_features(target, seq[None], drafter.target_layer_ids)
        hidden = drafter(feats, seq[None], anchors[None], target.get_input_embeddings())[0]  # [N, B, H]
        logits = hidden[:, 1:] @ target.get_output_embeddings().weight.T  # [N, B - 1, V]
    logp, tok = top_log_probs(logits, k)
    trees = build_trees(logp, tok, budget)
    cont = torch.stack([seq[p + 1: p + B] for p in anchors.tolist()])  # the greedy path after each anchor
    match = trees.token == cont.gather(1, trees.depth - 1)
    on = torch.zeros_like(match)
    for i in range(budget):  # parents precede their children
        par = trees.parent[:, i]
        up = torch.where(par >= 0, on.gather(1, par.clamp(min=0).unsqueeze(1)).squeeze(1), torch.ones_like(match[:, i]))
        on[:, i] = match[:, i] & up
    chain = (tok[:, :, 0] == cont).int().cumprod(dim=1).sum(dim=1)
    return {"score": trees.score.numpy(), "on": on.numpy(), "chain": chain.numpy(),
            "chain_score": logp[:, :, 0].cumsum(dim=1).numpy()}  # the greedy draft's prefix scores


def accepted(steps: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    on = steps["on"]
    return {"chain16": steps["chain"], **{s: on[:, :n].sum(axis=1) for s, n in NODES.items()}}


def calibration(score: np.ndarray, on: np.ndarray, bins: int = 24):
    """P(on path | exp(score)): isotonic (non-decreasing) over quantile bins of exp(score)."""
    p = np.exp(score).ravel()
    y = on.ravel().astype(float)
    edges = np.unique(np.quantile(p, np.linspace(0, 1, bins + 1)))
    idx = np.clip(np.searchsorted(edges, p, side="right") - 1, 0, len(edges) - 2)
    n = np.bincount(idx, minlength=len(edges) - 1).astype(float)
    f = np.bincount(idx, weights=y, minlength=len(edges) - 1) / np.maximum(n, 1)
    f = np.maximum.accumulate(np.where(n > 0, f, 0.0))  # pool-free monotone: a prefix maximum
    return lambda s: f[np.clip(np.searchsorted(edges, np.exp(s), side="right") - 1, 0, len(edges) - 2)]


def decode(prompt: dict[str, np.ndarray], choose) -> tuple[int, int, float]:
    """One prompt decoded from its first step position: (steps, tokens, ms). ``choose(prompt, i)`` -> (accepted,
    ms) of the step at position index i."""
    i, steps, tokens, ms = 0, 0, 0, 0.0
    n = prompt["on"].shape[0]
    while i < n:
        a, t = choose(prompt, i)
        steps, tokens, ms, i = steps + 1, tokens + int(a) + 1, ms + t, i + int(a) + 1
    return steps, tokens, ms


def policies(cost: dict[str, float], cal, lam: float) -> dict:
    """name -> choose(prompt, i): the fixed shapes, then the per-step rules over every shape: argmax E[tokens] -
    lam x cost (E: 1 + the summed path probabilities of the shape's nodes; the chain's nodes are the greedy draft's
    prefixes), and the outcome-knowing oracle."""
    def fixed(shape):
        return lambda pr, i: (pr["acc"][shape][i], cost[shape])

    def rule(prob):
        def choose(pr, i):
            p = prob(pr["score"][i])
            e = {"chain16": 1 + prob(pr["chain_score"][i]).sum(), **{t: 1 + p[:n].sum() for t, n in NODES.items()}}
            best = max(e, key=lambda t: e[t] - lam * cost[t])
            return pr["acc"][best][i], cost[best]
        return choose

    def oracle(pr, i):
        best = max(pr["acc"], key=lambda s: (1 + pr["acc"][s][i]) / cost[s])
        return pr["acc"][best][i], cost[best]

    return {**{s: fixed(s) for s in SHAPES}, "per-step": rule(cal), "raw": rule(np.exp), "oracle": oracle}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=48)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--costs", choices=sorted(COSTS), nargs="+", default=["cpu", "h200"])
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/tree_shape_offline.json")
    a = p.parse_args(argv)
    from transformers import AutoTokenizer

    from loadtest.dataset import load_prompts

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(str(REPO / "models/tiny-code/target"))
    target, drafter = load_pair()
    prompts = load_prompts(REPO / "loadtest/prompts/mix.jsonl")[: a.prompts]
    per_prompt = []
    for i, messages in enumerate(prompts):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        per_prompt.append(steps_of(target, drafter, ids, a.max_new, 16, 63))
        print(f"[offline] prompt {i + 1}/{len(prompts)}: {per_prompt[-1]['on'].shape[0]} steps", file=sys.stderr,
              flush=True)
    for pr in per_prompt:
        pr["acc"] = accepted(pr)
    half = len(per_prompt) // 2
    fit, test = per_prompt[:half], per_prompt[half:]
    cal = calibration(np.concatenate([pr["score"] for pr in fit]), np.concatenate([pr["on"] for pr in fit]))
    results = {}
    for costs in a.costs:
        cost = COSTS[costs]
        rows = {}

        def run(choose) -> dict:
            steps, tokens, ms = map(sum, zip(*(decode(pr, choose) for pr in test)))
            return {"tokens_per_step": tokens / steps, "ms_per_step": ms / steps, "tokens_per_ms": tokens / ms}

        for name, choose in policies(cost, cal, 0.0).items():
            if name in SHAPES:
                rows[name] = run(choose)
        best = max(rows, key=lambda s: rows[s]["tokens_per_ms"])
        lam = rows[best]["tokens_per_ms"]  # Dinkelbach: E - lam x cost maximises tokens / time at the optimum
        for name, choose in policies(cost, cal, lam).items():
            if name not in SHAPES:
                rows[name] = run(choose)
        base = rows["chain16"]["tokens_per_ms"]
        for r in rows.values():
            r["x_chain16"] = r["tokens_per_ms"] / base
        results[costs] = {"best_fixed": best, "rows": rows}
        print(f"\n#### costs: {costs} (ms per step at one request)\n"
              "| policy | tokens/step | ms/step | tokens/s x chain 16 |\n|---|---:|---:|---:|")
        for name, r in rows.items():
            print(f"| {name} | {r['tokens_per_step']:.2f} | {r['ms_per_step']:.2f} | {r['x_chain16']:.3f} |")
    steps = int(sum(pr["on"].shape[0] for pr in test))
    score = np.concatenate([pr["score"] for pr in test])
    on = np.concatenate([pr["on"] for pr in test])
    mean_p, mean_on = float(np.exp(score).mean()), float(on.mean())
    print(f"\n{len(test)} prompts evaluated ({steps} step positions), {half} fitted the calibration; a node's mean "
          f"exp(score) {mean_p:.3f}, share of nodes on the path {mean_on:.3f}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "step_positions": steps,
                                 "costs": {c: COSTS[c] for c in a.costs}, "results": results,
                                 "mean_node_prob": mean_p, "mean_node_on_path": mean_on}, indent=1) + "\n")
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
