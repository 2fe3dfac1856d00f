"""The GPU check's serving checks, each a function of its work folder returning its result's detail.

Servers are the product's own (`harness.server.ManagedServer`: `dflash-serve serve`), under the start-up hook
(check_hook.py: its log marks; with --torch-kernels, its test-only mode); orchestrate.py runs each check in its own
process with its own timeout.
"""
from __future__ import annotations

import os
import random
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

KIT = Path(__file__).resolve().parent
REPO = KIT.parents[1]
sys.path[:0] = [str(REPO), str(KIT)]

from check_hook import JIT_LOG_MARK, REPLAY_LOG_MARK  # noqa: E402
from sglang_ext import names  # noqa: E402

FELL_BACK = "falling back to eager path"  # upstream's warning when a Triton branch raised
UNCOUNTED = "were captured after the KV pool was sized"  # the worker's warning without post-capture KV sizing
CAPTURED = re.compile(r"captured target verify graphs for width (\d+)( \(a tree)?")
KV_TOKENS = re.compile(r"#tokens: (\d+)")
PROMPTS = [
    "import os\nimport sys\n\ndef main():\n", "for i in range(10):\n    print(i)\n",
    "class Foo:\n    def __init__(self):\n", "The quick brown fox jumps over the lazy dog. " * 3,
    "x = [1, 2, 3]\ny = {k: v for k, v in", "def fib(n):\n    if n < 2:\n        return n\n",
    "Explain what a hash map is.", "Write a Python function that reverses a string.",
]
TINY_NEW = 64
TREE_WIDTHS = [1, 4, 16, 32, 64]  # above the tiny drafter's block 16: trees of 31 and 63 nodes
BATCHES = [1, 8, 32, 64]
SIMULATED_ACCEPT = 6.0  # SGLANG_SIMULATE_ACC_LEN of the sweep's speculative variants
BIG_DIR = Path(os.environ.get("DFLASH_SERVE_GPU_CHECK_MODELS", "/tmp/dflash-gpu-check-models"))


@dataclass(frozen=True)
class Check:
    name: str
    phase: str  # "tiny" checks may run side by side; "compare" runs in the parent; "big" one at a time
    timeout_s: float
    run: Callable[[Path], dict]


# -- serving --------------------------------------------------------------------------------------------------------

def tiny_config(speculative: dict) -> dict:
    """The bundled pair in float32 on the GPU (comparisons bit for bit), small enough to share the GPU five ways."""
    pair = REPO / "models/tiny-code"
    spec = dict(speculative)
    if spec.get("algorithm", "none") != "none":
        spec.setdefault("draft_model_path", str(pair / "drafter"))
    return {
        "model": {"path": str(pair / "target"), "dtype": "float32", "served_name": "dflash-tiny"},
        "server": {"device": "cuda", "metrics": True, "max_running_requests": 16, "max_total_tokens": 32768},
        "speculative": spec,
        "sglang_args": {"mem_fraction_static": 0.15, "cuda_graph_max_bs_decode": 16},
    }


def big_config(speculative: dict, models: dict[str, Path]) -> dict:
    """The Qwen3-8B-shaped pair in bf16: random target weights (`load_format: dummy`), token ids in and out."""
    spec = dict(speculative)
    if spec.get("algorithm", "none") != "none":
        spec["draft_model_path"] = str(models["drafter"])
    return {
        "model": {"path": str(models["target"]), "dtype": "bfloat16", "served_name": "qwen3-8b-shaped"},
        "server": {"device": "cuda", "metrics": True, "max_running_requests": max(BATCHES)},
        "speculative": spec,
        "sglang_args": {"mem_fraction_static": 0.85, "load_format": "dummy", "skip_tokenizer_init": True,
                        "cuda_graph_bs_decode": BATCHES},
    }


def log_facts(text: str) -> dict:
    captured = [(int(w), bool(tree)) for w, tree in CAPTURED.findall(text)]
    return {
        "captured_verify_widths": sorted({w for w, tree in captured if not tree}),
        "captured_tree_widths": sorted({w for w, tree in captured if tree}),
        "replayed": sorted({line.split(REPLAY_LOG_MARK, 1)[1].strip() for line in text.splitlines()
                            if REPLAY_LOG_MARK in line}),
        "replayed_widths": sorted({int(w) for w in re.findall(re.escape(REPLAY_LOG_MARK) + r" (\d+)", text)}),
        "jit_kernels": sorted({line.split(JIT_LOG_MARK, 1)[1].strip() for line in text.splitlines()
                               if JIT_LOG_MARK in line and " failed: " not in line}),
        "jit_failed": sorted({line.split(JIT_LOG_MARK, 1)[1].strip()[:300] for line in text.splitlines()
                              if JIT_LOG_MARK in line and " failed: " in line}),
        "triton_fell_back": FELL_BACK in text,
        "verify_graphs_uncounted": UNCOUNTED in text,
        # sglang_ext/cpu/stubs.py: a stub op that is called raises "<op> was called, but it is a GPU kernel ..."
        "missing_kernels": sorted(set(re.findall(r"(\S+) was called, but it", text))),
        "kv_pool_tokens": [int(t) for t in KV_TOKENS.findall(text)],
    }


def _serve(cfg: dict, name: str, work: Path, env: dict[str, str] | None, body: Callable[[Any], dict]) -> dict:
    from harness.server import ManagedServer

    started = time.monotonic()
    server = ManagedServer(cfg, work, name, env=env, startup_timeout=420)
    try:
        server.start()
        startup = time.monotonic() - started
        detail = body(server)
    finally:
        server.stop()
    text = server.log_path.read_text(errors="replace")
    return {"startup_s": round(startup, 1), **detail, "log": log_facts(text), "log_file": server.log_path.name}


def _greedy(server) -> dict:
    single = [server.generate_text(p, max_new_tokens=TINY_NEW, temperature=0) for p in PROMPTS]
    batched = server.generate_text(PROMPTS, max_new_tokens=TINY_NEW, temperature=0)
    outs = single + batched
    return {"output_ids": [o["output_ids"] for o in outs],
            "accept_length": [o["meta_info"].get("spec_accept_length") for o in outs]}


def _sampling_smoke(server) -> dict:
    outs = server.generate_text(PROMPTS, max_new_tokens=32, temperature=1.0)
    lengths = [len(o["output_ids"]) for o in outs]
    return {"sampled_lengths": lengths, "sampled_ok": all(n == 32 for n in lengths)}


def _tree_steps(server) -> float:
    total = 0.0
    for line in server.metrics().splitlines():
        if line.startswith("dflash_tree_steps_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _tiny(work: Path, name: str, speculative: dict, env: dict | None = None, extra=None) -> dict:
    def body(server):
        out = _greedy(server)
        if extra is not None:
            out |= extra(server)
        return out

    detail = _serve(tiny_config(speculative), name, work, env, body)
    problems = _log_problems(detail["log"])
    return {"status": "fail" if problems else "pass", "problems": problems, **detail}


def _log_problems(facts: dict) -> list[str]:
    problems = []
    if facts["triton_fell_back"]:
        problems.append("a Triton branch fell back to the eager path")
    if facts["missing_kernels"]:
        problems.append(f"stub kernels were called: {facts['missing_kernels']}")
    if facts["verify_graphs_uncounted"]:
        problems.append("verify graphs were captured after the KV pool was sized (no post-capture KV sizing)")
    return problems


def check_tiny_plain(work: Path) -> dict:
    return _tiny(work, "tiny-plain", {"algorithm": "none"})


def check_tiny_dflash(work: Path) -> dict:
    return _tiny(work, "tiny-dflash", {"algorithm": "dflash"})


def check_tiny_adaptive_cycle(work: Path) -> dict:
    out = _tiny(work, "tiny-adaptive-cycle", {"algorithm": "dflash_adaptive", "adaptive": {"mode": "cycle"}},
                extra=_sampling_smoke)
    if not out["log"]["captured_verify_widths"]:
        out["problems"].append("no per-width verify graph was captured")
    unreplayed = sorted(set(out["log"]["captured_verify_widths"]) - set(out["log"]["replayed_widths"]))
    if not out["log"]["replayed"] or unreplayed:
        out["problems"].append(f"verify graphs captured but never replayed: widths {unreplayed}")
    if not out.get("sampled_ok"):
        out["problems"].append(f"sampling at temperature 1 returned lengths {out.get('sampled_lengths')}")
    out["status"] = "fail" if out["problems"] else "pass"
    return out


def check_tiny_adaptive_trees(work: Path) -> dict:
    out = _tiny(work, "tiny-adaptive-trees",
                {"algorithm": "dflash_adaptive", "adaptive": {"mode": "cycle", "candidates": TREE_WIDTHS}},
                env={names.GPU_TREES: "1"}, extra=lambda s: {"tree_steps": _tree_steps(s)})
    if not out.get("tree_steps"):
        out["problems"].append("no tree step ran")
    wanted = [w for w in TREE_WIDTHS if w > 16]
    if out["log"]["captured_tree_widths"] != wanted:
        out["problems"].append(f"tree verify graphs captured for {out['log']['captured_tree_widths']}, not {wanted}")
    out["status"] = "fail" if out["problems"] else "pass"
    return out


def check_tiny_adaptive_dflash2(work: Path) -> dict:
    """The bundled drafter with DFlash2's selector and convolutions added (dflash_models/dflash2.py): the selector's
    walk inside the draft CUDA graph, its path verified at every width, its q accepted for sampled requests."""
    from dflash_models import dflash2

    drafter = dflash2.convert(REPO / "models/tiny-code/drafter", work / "dflash2-drafter")
    out = _tiny(work, "tiny-adaptive-dflash2", {"algorithm": "dflash_adaptive", "draft_model_path": str(drafter),
                                                "adaptive": {"mode": "cycle"}}, extra=_sampling_smoke)
    if not out.get("sampled_ok"):
        out["problems"].append(f"sampling at temperature 1 returned lengths {out.get('sampled_lengths')}")
    out["status"] = "fail" if out["problems"] else "pass"
    return out


def compare_greedy(results: dict[str, dict]) -> dict:
    """Greedy outputs of every speculative tiny check against plain decoding's, token for token."""
    base = results.get("tiny_plain", {}).get("detail", {}).get("output_ids")
    if base is None:
        return {"status": "skipped", "why": "tiny_plain produced no outputs"}
    detail = {}
    for name in ("tiny_dflash", "tiny_adaptive_cycle", "tiny_adaptive_trees", "tiny_adaptive_dflash2"):
        spec = results.get(name, {}).get("detail", {}).get("output_ids")
        if spec is None:
            detail[name] = "no outputs"
            continue
        first = [next((i for i, (x, y) in enumerate(zip(b, s)) if x != y), None if len(b) == len(s) else -1)
                 for b, s in zip(base, spec)]
        detail[name] = {"identical": sum(f is None for f in first), "of": len(first),
                        "first_divergence": [f for f in first if f is not None]}
    ok = all(isinstance(d, dict) and d["identical"] == d["of"] for d in detail.values())
    return {"status": "pass" if ok else "fail", "detail": detail}


def _models() -> dict[str, Path]:
    from models import build

    return build(BIG_DIR)


def _requests(server, batch: int, new: int) -> float:
    rng = random.Random(batch)
    prompts = [[rng.randrange(1000, 150000) for _ in range(128)] for _ in range(batch)]
    with ThreadPoolExecutor(batch) as pool:
        outs = list(pool.map(lambda ids: server.generate(ids, max_new_tokens=new, temperature=0), prompts))
    return float(sum(len(o["output_ids"]) for o in outs))


def _step_sums(server) -> dict[str, tuple[float, float]]:
    sums, counts = {}, {}
    for line in server.metrics().splitlines():
        m = re.match(r'^dflash_step_seconds_(sum|count)\{[^}]*block_size="([^"]+)"[^}]*\} (\S+)$', line)
        if m:
            (sums if m.group(1) == "sum" else counts)[m.group(2)] = float(m.group(3))
    return {b: (sums.get(b, 0.0), counts.get(b, 0.0)) for b in counts}


def check_big_adaptive_steps(work: Path) -> dict:
    """Start-up (post-capture KV sizing), then each width's mean step time at batch 1/8/32/64 (cycle mode: every
    width every few steps) next to the cost model's packaged H200 seed for that batch."""
    from sglang_ext.controller.cost_model import CostModel
    from sglang_ext.controller.config import ControllerConfig

    models = _models()
    cands = ControllerConfig().candidates_for(16)
    seed = CostModel.default(cands)

    def body(server):
        table = {}
        for batch in BATCHES:
            before = _step_sums(server)
            _requests(server, batch, 48)
            after = _step_sums(server)
            row = seed.row(batch)
            table[batch] = {}
            for k, width in enumerate(cands):
                s1, c1 = after.get(str(width), (0.0, 0.0))
                s0, c0 = before.get(str(width), (0.0, 0.0))
                steps = c1 - c0
                measured = (s1 - s0) / steps if steps else None
                table[batch][width] = {"steps": steps, "measured_s": measured, "seed_s": float(row[k]),
                                       "measured_over_seed": None if measured is None else measured / float(row[k])}
        return {"step_time_by_batch": table}

    detail = _serve(big_config({"algorithm": "dflash_adaptive", "adaptive": {"mode": "cycle"}}, models),
                    "big-adaptive-steps", work, None, body)
    problems = _log_problems(detail["log"])
    if not detail["log"]["captured_verify_widths"]:
        problems.append("no per-width verify graph was captured")
    return {"status": "fail" if problems else "pass", "problems": problems, **detail}


def _sweep(work: Path, name: str, speculative: dict, env: dict | None) -> dict:
    models = _models()

    def body(server):
        points = {}
        for batch in BATCHES:
            t0 = time.monotonic()
            tokens = _requests(server, batch, 64)
            points[batch] = {"tokens": tokens, "seconds": time.monotonic() - t0,
                             "tokens_per_s": tokens / (time.monotonic() - t0)}
        return {"throughput_by_batch": points}

    detail = _serve(big_config(speculative, models), name, work, env, body)
    problems = _log_problems(detail["log"])
    return {"status": "fail" if problems else "pass", "problems": problems, **detail}


def check_big_sweep_plain(work: Path) -> dict:
    return _sweep(work, "big-sweep-plain", {"algorithm": "none"}, None)


def check_big_sweep_fixed16(work: Path) -> dict:
    return _sweep(work, "big-sweep-fixed16", {"algorithm": "dflash"}, {"SGLANG_SIMULATE_ACC_LEN": str(SIMULATED_ACCEPT)})


def check_big_sweep_adaptive(work: Path) -> dict:
    return _sweep(work, "big-sweep-adaptive", {"algorithm": "dflash_adaptive"},
                  {"SGLANG_SIMULATE_ACC_LEN": str(SIMULATED_ACCEPT)})


CHECKS = [
    Check("tiny_plain", "tiny", 300, check_tiny_plain),
    Check("tiny_dflash", "tiny", 300, check_tiny_dflash),
    Check("tiny_adaptive_cycle", "tiny", 300, check_tiny_adaptive_cycle),
    Check("tiny_adaptive_trees", "tiny", 300, check_tiny_adaptive_trees),
    Check("tiny_adaptive_dflash2", "tiny", 300, check_tiny_adaptive_dflash2),
    Check("tiny_greedy_matches_plain", "compare", 5, lambda work: {}),
    Check("big_adaptive_steps", "big", 300, check_big_adaptive_steps),
    Check("big_sweep_plain", "big", 180, check_big_sweep_plain),
    Check("big_sweep_fixed16", "big", 180, check_big_sweep_fixed16),
    Check("big_sweep_adaptive", "big", 180, check_big_sweep_adaptive),
]
