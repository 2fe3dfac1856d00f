"""What DDTree's per-step tensor logic costs on this machine, for a batch, at the loads and budgets the worker
serves: the marginals (tree/marginals.py: top-K of the drafter's logits and their normalisation, after the LM head
every draft pays),
tree construction, ancestor mask, accept walk and the window's reorder (sglang_ext/tree/, steps/draft.py marginals).

Random logits of the bundled pair's shape (15 draft positions after the anchor, its vocabulary), K = min(budget,
16) as the worker uses, one torch thread (what the CPU server runs with at server.cpu_threads auto on 2 cores).
Median of --repeats timed calls after a warm-up. The walk is timed with a target that agrees with the tree's first
child at every node (the deepest walk).

    python benchmarks/tree_cost.py [--loads 1 16 50] [--budgets 15 31 63]

On a CUDA GPU (``--device cuda``, timed by CUDA events) it also times the whole step replayed as one CUDA graph per
(load, budget) -- what a GPU tree step would capture (tests/gpu/test_tree_gpu.py checks the replay equals the eager
step and that no part of it syncs with the host):

    python benchmarks/tree_cost.py --device cuda --dtype bfloat16 --vocab 151936 --loads 1 50 --budgets 15 31 63

``--marginal-variants`` times only the marginals against the plain torch.topk + logsumexp they replace.
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

from sglang_ext.tree.build import Trees, build_trees  # noqa: E402
from sglang_ext.tree.commit import window_order  # noqa: E402
from sglang_ext.tree.marginals import top_log_probs  # noqa: E402
from sglang_ext.tree.mask import ancestor_mask  # noqa: E402
from sglang_ext.tree.mask import positions as tree_positions  # noqa: E402
from sglang_ext.tree.walk import walk  # noqa: E402


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median ms of ``repeats`` calls after a warm-up (CUDA: each call between two synchronisations)."""
    cuda = device.type == "cuda"
    fn()
    out = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e3


def first_child_choice(trees: Trees) -> torch.Tensor:
    """A target that, after every node, picks the token of its first child (the walk goes as deep as the first
    children go), [bs, 1 + N]; nodes without children get token 0. No host sync: capturable in a CUDA graph."""
    bs, n = trees.token.shape
    child = torch.full((bs, n + 1), n, dtype=torch.int64, device=trees.token.device)
    child.scatter_reduce_(1, trees.parent + 1, torch.arange(n, device=child.device).expand(bs, n), "amin")
    token = torch.cat([trees.token, torch.zeros_like(trees.token[:, :1])], dim=1)
    return token.gather(1, child)


def tree_step(logits: torch.Tensor, n: int, k: int) -> dict[str, torch.Tensor]:
    """A tree step's own tensor logic, as steps/tree.py decode_tree runs it: marginals, the ``n`` best prefixes, the
    ancestor mask and positions, the walk of a target that picks every node's first child, the window's order.
    ``logits`` [bs, D, V]: the drafter's logits at the D drafted positions."""
    bs, depth, _ = logits.shape
    values, indices = top_log_probs(logits, k)
    trees = build_trees(values, indices, n)
    mask = ancestor_mask(trees.parent)
    prefix_lens = torch.zeros(bs, dtype=torch.int64, device=logits.device)
    accepted, path, bonus = walk(trees, first_child_choice(trees), depth=depth, mask=mask)
    return {"token": trees.token, "depth": trees.depth, "parent": trees.parent, "score": trees.score, "mask": mask,
            "positions": tree_positions(prefix_lens, trees.depth), "accepted": accepted, "path": path,
            "bonus": bonus, "order": window_order(path, n + 1)}


def captured(fn):
    """``fn`` (no arguments, reading and writing static tensors) captured as one CUDA graph after a warm-up on a
    side stream (torch.cuda.graphs' recipe): (graph, fn's outputs, which every replay rewrites)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def plain_marginals(logits: torch.Tensor, k: int, upcast: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """What tree/marginals.py replaces: torch.topk and torch.logsumexp over the whole vocabulary."""
    x = logits.float() if upcast else logits
    values, tokens = torch.topk(x, k, dim=-1)
    return values.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True), tokens


def marginal_variants(loads: list[int], depth: int, vocab: int, dtype: torch.dtype, k: int, repeats: int,
                      device: torch.device) -> list[dict]:
    """ms per call of the chunked top-k against the plain one, in a CUDA graph on CUDA (eager on CPU)."""
    rows = []
    for bs in loads:
        g = torch.Generator().manual_seed(bs)
        logits = (torch.randn(bs, depth, vocab, generator=g) * 3).to(device, dtype)
        row = {"requests": bs}
        for name, fn in (("chunked", lambda: top_log_probs(logits, k)),
                         ("topk", lambda: plain_marginals(logits, k, upcast=False)),
                         ("topk_float32", lambda: plain_marginals(logits, k, upcast=True))):
            run = captured(fn)[0].replay if device.type == "cuda" else fn
            row[f"{name}_ms"] = timed(run, repeats, device)
        rows.append(row)
        print(" | ".join(f"{key} {v:.3f}" if key.endswith("_ms") else f"{key} {v}" for key, v in row.items()),
              flush=True)
    return rows


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
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the drafter's logits (a GPU drafter's LM head writes bfloat16)")
    p.add_argument("--marginal-variants", action="store_true",
                   help="only time the chunked top-k against torch.topk + logsumexp at each load (K = max --topk)")
    p.add_argument("--out", type=Path, help="default: benchmarks/results/tree_cost_<device type>.json")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    out_path = a.out or REPO / f"benchmarks/results/tree_cost_{'gpu' if cuda else 'cpu'}.json"
    torch.set_num_threads(a.threads)
    if a.marginal_variants:
        marginal_variants(a.loads, a.depth, a.vocab, getattr(torch, a.dtype), max(a.topk), a.repeats, device)
        return 0
    rows = []
    print("| requests | budget | top-K | marginals ms | build ms | mask ms | walk ms | reorder ms | total ms | "
          "step ms" + (" | graph ms |" if cuda else " |") + "\n"
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if cuda else ""))
    for bs in a.loads:
        g = torch.Generator().manual_seed(bs)
        logits = (torch.randn(bs, a.depth, a.vocab, generator=g) * 3).to(device, getattr(torch, a.dtype))
        for n in a.budgets:
            for k in sorted({min(k, n) for k in a.topk}):
                def marginals():
                    return top_log_probs(logits, k)
                values, indices = marginals()
                trees = build_trees(values, indices, n)
                choice = first_child_choice(trees)  # the deepest walk the tree's first children allow
                mask = ancestor_mask(trees.parent)
                _, path, _ = walk(trees, choice, depth=a.depth, mask=mask)
                r = {"requests": bs, "budget": n, "topk": k,
                     "marginals_ms": timed(marginals, a.repeats, device),
                     "build_ms": timed(lambda: build_trees(values, indices, n), a.repeats, device),
                     "mask_ms": timed(lambda: ancestor_mask(trees.parent), a.repeats, device),
                     "walk_ms": timed(lambda: walk(trees, choice, depth=a.depth, mask=mask), a.repeats, device),
                     "reorder_ms": timed(lambda: window_order(path, n + 1), a.repeats, device)}
                r["total_ms"] = sum(v for key, v in r.items() if key.endswith("_ms"))
                r["step_ms"] = timed(lambda: tree_step(logits, n, k), a.repeats, device)  # one call, as it runs
                line = (f"| {bs} | {n} | {k} | {r['marginals_ms']:.3f} | {r['build_ms']:.3f} | {r['mask_ms']:.3f} | "
                        f"{r['walk_ms']:.3f} | {r['reorder_ms']:.3f} | {r['total_ms']:.3f} | {r['step_ms']:.3f} |")
                if cuda:
                    graph, _ = captured(lambda: tree_step(logits, n, k))
                    r["graph_ms"] = timed(graph.replay, a.repeats, device)
                    line += f" {r['graph_ms']:.3f} |"
                    del graph
                rows.append(r)
                print(line, flush=True)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({
        "depth": a.depth, "vocab": a.vocab, "threads": a.threads, "repeats": a.repeats, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if cuda else None, "logits_dtype": a.dtype,
        "torch": torch.__version__, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
