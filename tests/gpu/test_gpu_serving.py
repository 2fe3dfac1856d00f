"""On a CUDA GPU: DFLASH_ADAPTIVE (per-width verify CUDA graphs, FlashInfer draft attention, draft CUDA graph, the
overlap scheduler) is lossless against no speculation -- switching width every step, and under the adaptive
controller's own choices with 1-50 concurrent clients; penalties, min_new_tokens and min_p are served as plain
decoding serves them; the per-width verify graphs are counted by SGLang's post-capture KV sizing; upstream's
Triton accept kernel never falls back. Throughput next to no-spec and fixed widths 4 / 8 / 16 at concurrency 1, 8,
32, 50 is recorded (benchmarks/results/gpu_throughput.json), never asserted."""
from __future__ import annotations

import json
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from benchmarks.adaptive_throughput import default_prompts, measured_profile, run_config, table, variant
from harness.server import ManagedServer, http_json
from sglang_ext import names
from tests.conftest import PROMPTS
from tests.greedy_compare import assert_same_greedy, greedy_mismatches
from tests.integration.test_adaptive import scrape
from tests.gpu.conftest import REPO
from tests.sampling_stats import min_p_violations

LEVELS = [1, 8, 32, 50]
FELL_BACK = "falling back to eager path"  # upstream's warning when a Triton branch raised
UNCOUNTED = "were captured after the KV pool was sized"  # the worker's warning without post-capture KV sizing
WIDTHS = [4, 8, 16]
TREE_WIDTHS = [1, 4, 16, 32, 64]  # above the b16 drafter's block: trees of 31 and 63 nodes
MAX_NEW = 128


def _greedy(cfg: dict, name: str, prompts: list[str], env: dict[str, str] | None = None,
            metric: str | None = None):
    """(one request at a time, the batch at once, the server log[, the sum of ``metric`` on /metrics])."""
    with tempfile.TemporaryDirectory() as tmp, ManagedServer(cfg, Path(tmp), name, env=env) as server:
        single = [server.generate_text(p, max_new_tokens=MAX_NEW, temperature=0) for p in prompts]
        batched = server.generate_text(prompts, max_new_tokens=MAX_NEW, temperature=0)
        log = server.log_tail(400)
        if metric is not None:
            return single, batched, log, sum(scrape(server, metric).values())
    return single, batched, log


def test_adaptive_greedy_matches_no_speculation(gpu_config):
    prompts = PROMPTS + ["Explain what a hash map is.", "Write a Python function that reverses a string."]
    plain = dict(gpu_config, speculative={"algorithm": "none"})
    cycling = json.loads(json.dumps(gpu_config))
    cycling["speculative"]["adaptive"] = {"mode": "cycle"}  # every width, switching every step
    base, base_batched, _ = _greedy(plain, "plain", prompts)
    spec, spec_batched, log = _greedy(cycling, "cycle", prompts)
    assert "captured target verify graphs for width" in log, "per-width verify CUDA graphs were not captured"
    strict = gpu_config["model"]["dtype"] == "float32"
    assert_same_greedy([b["output_ids"] for b in base + base_batched], [s["output_ids"] for s in spec + spec_batched],
                       strict)
    assert max(s["meta_info"]["spec_accept_length"] for s in spec) > 2.0


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
def test_tree_widths_verify_with_their_mask_and_match_no_speculation(gpu_config, backend, graphs):
    """DDTree on GPU (the opt-in names.GPU_TREES; FlashInfer or Triton target attention): chain and tree widths
    switching every step, greedy outputs equal plain decoding's, one request at a time and batched; tree steps ran.
    With CUDA graphs each tree width's verify graph was captured with the custom mask (verify_runtimes.py: one
    captured without it would attend causally over the tree); without, the same trees verify eagerly."""
    prompts = PROMPTS + ["Explain what a hash map is.", "Write a Python function that reverses a string."]
    args = {**gpu_config.get("sglang_args", {}), "attention_backend": backend}
    if not graphs:
        args["cuda_graph_backend_decode"] = "disabled"
    plain = dict(gpu_config, speculative={"algorithm": "none"}, sglang_args=args)
    trees = json.loads(json.dumps(dict(gpu_config, sglang_args=args)))
    trees["speculative"]["adaptive"] = {"mode": "cycle", "candidates": TREE_WIDTHS}
    name = f"{backend}-{'graphs' if graphs else 'eager'}"
    base, base_batched, _ = _greedy(plain, f"plain-{name}", prompts)
    spec, spec_batched, log, tree_steps = _greedy(trees, f"trees-{name}", prompts, env={names.GPU_TREES: "1"},
                                                  metric="dflash_tree_steps_total")
    strict = gpu_config["model"]["dtype"] == "float32"
    assert_same_greedy([b["output_ids"] for b in base + base_batched], [s["output_ids"] for s in spec + spec_batched],
                       strict)
    assert tree_steps > 0, "no tree step ran"
    captured = [w for w in TREE_WIDTHS if f"captured target verify graphs for width {w} (a tree" in log]
    assert captured == ([w for w in TREE_WIDTHS if w > 16] if graphs else []), log


def test_adaptive_controller_traffic_at_1_to_50_clients_is_lossless_and_counted(gpu_config):
    """The controller's own width choices (no cycle mode) while load moves from 1 to 50 clients: every greedy
    output equals plain decoding's, the Triton accept kernel never fell back (the accept buffers are sized for the
    trained block), and the verify graphs were captured and counted by post-capture KV sizing."""
    prompts = (PROMPTS + ["Explain what a hash map is.", "Write a Python function that reverses a string."]) * 7
    plain = dict(gpu_config, speculative={"algorithm": "none"})
    strict = gpu_config["model"]["dtype"] == "float32"
    outputs = {}
    for name, cfg in (("plain", plain), ("adaptive", gpu_config)):
        with tempfile.TemporaryDirectory() as tmp, ManagedServer(cfg, Path(tmp), name) as server:
            runs = {}
            for clients in (1, 8, 50):
                with ThreadPoolExecutor(clients) as pool:
                    runs[clients] = list(pool.map(lambda p: server.generate_text(
                        p, max_new_tokens=MAX_NEW, temperature=0)["output_ids"], prompts[:max(clients, 8)]))
            outputs[name], log = runs, server.log_tail(2000)
    for clients, base in outputs["plain"].items():
        problems = greedy_mismatches(base, outputs["adaptive"][clients], strict)
        assert not problems, (clients, problems)
    assert FELL_BACK not in log
    assert "captured target verify graphs for width" in log
    assert "Post-capture KV sizing" in log and UNCOUNTED not in log


def _sampling_cases(target: str) -> dict[str, dict]:
    """Each penalty, and min_new_tokens against an EOS pushed up so that plain decoding would stop early without it
    (ManagedServer ignores EOS unless told otherwise)."""
    from transformers import AutoTokenizer

    eos_bias = {"ignore_eos": False, "logit_bias": {str(AutoTokenizer.from_pretrained(target).eos_token_id): 8.0}}
    return {"repetition_penalty": {"repetition_penalty": 1.3}, "frequency_penalty": {"frequency_penalty": 1.0},
            "presence_penalty": {"presence_penalty": 1.0}, "eos_early": eos_bias,
            "min_new_tokens": {"min_new_tokens": 48, **eos_bias}}


def test_penalties_and_min_p_are_served_as_plain_decoding_serves_them(gpu_config):
    """Greedy with each penalty (and min_new_tokens) equals plain decoding for dflash and dflash_adaptive (the overlap
    scheduler is off for them: DFlash refuses penalties under it, naming the fix); min_p at temperature 1 never
    samples a token min_p forbids, judged by the target's own log-probabilities of the sampled continuation."""
    prompts = PROMPTS[:4]
    cases = _sampling_cases(gpu_config["model"]["path"])
    no_overlap = {**gpu_config.get("sglang_args", {}), "disable_overlap_schedule": True}
    cfgs = {"plain": dict(gpu_config, speculative={"algorithm": "none"}, sglang_args=no_overlap),
            "dflash": dict(gpu_config, speculative={"algorithm": "dflash",
                                                    "draft_model_path": os.environ["DFLASH_GPU_DRAFTER"]},
                           sglang_args=no_overlap),
            "adaptive": dict(gpu_config, sglang_args=no_overlap)}
    outputs = {}
    for name, cfg in cfgs.items():
        with tempfile.TemporaryDirectory() as tmp, ManagedServer(cfg, Path(tmp), name) as server:
            outputs[name] = {k: [server.generate_text(p, max_new_tokens=64, temperature=0, **extra)["output_ids"]
                                 for p in prompts] for k, extra in cases.items()}
            if name != "plain":
                outputs[name]["min_p_forbidden"] = _min_p_forbidden(server, cfg["model"]["served_name"], prompts,
                                                                     0.5)
    strict = gpu_config["model"]["dtype"] == "float32"
    plain = outputs["plain"]  # the EOS bias stops plain decoding early; min_new_tokens holds it off
    assert max(map(len, plain["eos_early"])) < 48 <= min(map(len, plain["min_new_tokens"]))
    for name in ("dflash", "adaptive"):
        for k in cases:
            problems = greedy_mismatches(outputs["plain"][k], outputs[name][k], strict)
            assert not problems, (name, k, problems)
        assert outputs[name]["min_p_forbidden"] == 0, name


def _min_p_forbidden(server, model: str, prompts: list[str], min_p: float) -> int:
    """Sampled tokens min_p forbids, scored by the same server's target prefill (tests/sampling_stats.py)."""
    bad = 0
    for p in prompts:
        ids = http_json(f"{server.url}/v1/tokenize", {"model": model, "prompt": p})["tokens"]
        out = server.generate(ids, max_new_tokens=64, temperature=1.0, min_p=min_p)["output_ids"]
        bad += min_p_violations(server.url, ids, out, min_p)
    return bad


def test_record_throughput(gpu_config):
    """A recording, not a speed check (performance lives in benchmarks): throughput of no-spec, fixed 4 / 8 / 16
    and adaptive at 1-50 clients into benchmarks/results/gpu_throughput.json. What it asserts is that no request
    failed under any of those loads."""
    prompts = default_prompts(gpu_config["model"]["path"], 64)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ["no-spec"] + [f"fixed-{b}" for b in WIDTHS]:
            results[name] = run_config(variant(gpu_config, name), name, prompts, LEVELS, MAX_NEW, None, Path(tmp))
        profile = REPO / "benchmarks/results/gpu_profile.json"
        profile.write_text(json.dumps(measured_profile(results, WIDTHS, LEVELS), indent=2) + "\n")
        results["adaptive"] = run_config(variant(gpu_config, "adaptive", profile), "adaptive", prompts, LEVELS,
                                         MAX_NEW, None, Path(tmp))
    md = table(results, LEVELS, list(results), {})
    print(md)
    out = REPO / "benchmarks/results/gpu_throughput.json"
    out.write_text(json.dumps({"levels": LEVELS, "results": results, "table": md,
                               "target": os.environ["DFLASH_GPU_TARGET"]}, indent=2) + "\n")
    assert all(p["errors"] == 0 for pts in results.values() for p in pts)
