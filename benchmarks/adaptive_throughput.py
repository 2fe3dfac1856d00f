"""Output tokens/s vs concurrency: no speculation, DFlash at each fixed verify width, and adaptive.

Every configuration runs through a real `dflash-serve` server, one server at a time, on the same prompts:
  no-spec            speculative.algorithm none
  fixed-b            dflash_adaptive, mode fixed (full-block draft, verify width b)
  adaptive           dflash_adaptive, mode adaptive, seeded with the step costs measured by the fixed runs
At each concurrency C a closed loop of C clients sends `--requests` greedy requests (default max(12, C)) of
`--max-new` tokens (ignore_eos, so every configuration decodes the same number of tokens).

The fixed runs also measure the cost model's inputs: step time per (batch, width) from `dflash_step_seconds` and
per-position acceptance from the width-16 run. From them the benchmark writes a measured cost profile (the
controller's seed for the adaptive run) and predicts each fixed configuration's tokens/s as
C * E(b) / T(C, b), printed next to the measurement. Prints markdown tables, writes JSON and a PNG.

    python benchmarks/adaptive_throughput.py [--config deploy/configs/cpu.yaml] [--concurrency 1 2 4 8 16 32 50]
"""
from __future__ import annotations

import argparse
import json
import queue
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

from harness.server import ManagedServer  # noqa: E402


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def base_config(path: Path) -> dict:
    cfg = yaml.safe_load(path.read_text())
    for section, key in (("model", "path"), ("speculative", "draft_model_path")):
        p = Path(cfg[section][key])
        cfg[section][key] = str(p if p.is_absolute() else (path.parent / p).resolve())
    cfg.setdefault("server", {})["max_running_requests"] = max(64, cfg["server"].get("max_running_requests") or 0)
    return cfg


def variant(cfg: dict, name: str, profile: Path | None = None) -> dict:
    cfg = json.loads(json.dumps(cfg))
    drafter = cfg["speculative"]["draft_model_path"]
    if name == "no-spec":
        cfg["speculative"] = {"algorithm": "none"}
    elif name.startswith("fixed-"):
        b = int(name.split("-")[1])
        cfg["speculative"] = {"algorithm": "dflash_adaptive", "draft_model_path": drafter,
                              "adaptive": {"mode": "fixed", "fixed_block": b}}
    elif name == "adaptive":
        adaptive = {"cost_profile": str(profile)} if profile else {}
        cfg["speculative"] = {"algorithm": "dflash_adaptive", "draft_model_path": drafter, "adaptive": adaptive}
    else:
        raise ValueError(f"unknown configuration {name!r}")
    return cfg


def default_prompts(tokenizer_dir: str, n: int) -> list[list[int]]:
    """Held-out prompts (stdlib files the bundled pair never trained on) when the training helpers exist."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    try:
        from dflash_models import corpus, data

        split = corpus.split_files(corpus.stdlib_files())
        texts = [p.text for p in data.prompts(split.heldout, n, 1234)]
    except ImportError:
        from tests.conftest import PROMPTS

        texts = (PROMPTS * n)[:n]
    return [tok(t, add_special_tokens=False)["input_ids"][-192:] for t in texts]


def scrape(server: ManagedServer) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in server.metrics().splitlines():
        m = re.match(r"^(dflash_step_seconds_(?:sum|count)|dflash_block_size_steps_total"
                     r"|dflash_(?:accepted|tried)_tokens_by_position_total)\{([^}]*)\} (\S+)$", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            key = m.group(1) + ":" + (labels.get("block_size") or labels.get("position") or "")
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def run_point(server: ManagedServer, prompts: list[list[int]], concurrency: int, n_requests: int,
              max_new: int) -> dict:
    work: queue.Queue = queue.Queue()
    for i in range(n_requests):
        work.put(prompts[i % len(prompts)])
    results, errors = [], []

    def client():
        while True:
            try:
                ids = work.get_nowait()
            except queue.Empty:
                return
            try:
                results.append(server.generate(ids, max_new_tokens=max_new, temperature=0)["meta_info"])
            except Exception as e:  # counted, reported; a benchmark with errors is not a result
                errors.append(repr(e))

    warm = [threading.Thread(target=server.generate, args=(prompts[i % len(prompts)],),
                             kwargs={"max_new_tokens": 8, "temperature": 0}) for i in range(concurrency)]
    for t in warm:  # untimed round at this concurrency: first batches of a new size are slow (allocation)
        t.start()
    for t in warm:
        t.join()
    before = scrape(server)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    after = scrape(server)
    tokens = sum(m["completion_tokens"] for m in results)
    verify = sum(m.get("spec_verify_ct", 0) for m in results)
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    point = {"concurrency": concurrency, "requests": len(results), "errors": len(errors), "seconds": wall,
             "tokens": tokens, "tokens_per_s": tokens / wall,
             "accept_length": tokens / verify if verify else None,
             "block_steps": {k.split(":")[1]: v for k, v in delta.items()
                             if k.startswith("dflash_block_size_steps_total") and v > 0},
             "step_seconds": {k.split(":")[1]: delta[k] / delta[k.replace("_sum", "_count")]
                              for k in delta if k.startswith("dflash_step_seconds_sum")
                              and delta.get(k.replace("_sum", "_count"), 0) > 0},
             "accepted_by_position": {k.split(":")[1]: v for k, v in delta.items()
                                      if k.startswith("dflash_accepted_tokens_by_position_total")},
             "tried_by_position": {k.split(":")[1]: v for k, v in delta.items()
                                   if k.startswith("dflash_tried_tokens_by_position_total")}}
    if errors:
        point["error_examples"] = errors[:3]
    return point


def run_config(cfg: dict, name: str, prompts, levels, max_new: int, requests: int | None, workdir: Path) -> list[dict]:
    log(f"starting {name}")
    with ManagedServer(cfg, workdir, name) as server:
        server.generate(prompts[0], max_new_tokens=8, temperature=0)  # warm-up
        points = []
        for c in levels:
            p = run_point(server, prompts, c, requests or max(12, c), max_new)
            points.append(p)
            log(f"{name} C={c}: {p['tokens_per_s']:.1f} tok/s ({p['requests']} requests, {p['errors']} errors"
                + (f", accept {p['accept_length']:.2f}" if p["accept_length"] else "")
                + (f", widths {p['block_steps']}" if name == "adaptive" else "") + ")")
        return points


def acceptance(points: list[dict]) -> list[float]:
    """Per-position conditional acceptance p_j pooled over a width-B run's points."""
    acc: dict[str, float] = {}
    tried: dict[str, float] = {}
    for p in points:
        for k, v in p["accepted_by_position"].items():
            acc[k] = acc.get(k, 0.0) + v
        for k, v in p["tried_by_position"].items():
            tried[k] = tried.get(k, 0.0) + v
    return [acc.get(str(j), 0.0) / tried[str(j)] if tried.get(str(j)) else 0.0 for j in range(1, len(tried) + 1)]


def expected_tokens(p: list[float], b: int) -> float:
    e, run = 1.0, 1.0
    for j in range(b - 1):
        run *= p[j]
        e += run
    return e


def measured_profile(results: dict, widths: list[int], levels: list[int]) -> dict:
    seconds = []
    for c_index, _ in enumerate(levels):
        row = []
        for b in widths:
            pt = results[f"fixed-{b}"][c_index]
            row.append(pt["step_seconds"].get(str(b), 0.0))
        seconds.append(row)
    return {"name": "measured by benchmarks/adaptive_throughput.py", "batch_buckets": levels, "block_sizes": widths,
            "seconds": seconds}


def table(results: dict, levels: list[int], configs: list[str], predicted: dict) -> str:
    head = "| config | " + " | ".join(f"C={c}" for c in levels) + " |"
    rows = [head, "|---|" + "---:|" * len(levels)]
    for name in configs:
        cells = []
        for i, _ in enumerate(levels):
            tps = results[name][i]["tokens_per_s"]
            pred = predicted.get(name, [None] * len(levels))[i]
            cells.append(f"{tps:.1f}" + (f" (pred {pred:.0f})" if pred else ""))
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    best = []
    for i, _ in enumerate(levels):
        fixed = [results[n][i]["tokens_per_s"] for n in configs if n.startswith("fixed-")]
        a = results["adaptive"][i]["tokens_per_s"] if "adaptive" in results else float("nan")
        nospec = results["no-spec"][i]["tokens_per_s"]
        best.append(f"{a / max(fixed):.2f} / {a / nospec:.2f}")
    rows.append("| adaptive ÷ best fixed / ÷ no-spec | " + " | ".join(best) + " |")
    return "\n".join(rows)


def plot(results: dict, levels: list[int], configs: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    for name in configs:
        style = {"no-spec": dict(color="black", ls="--"), "adaptive": dict(color="tab:red", lw=2.5)}.get(name, {})
        ax.plot(levels, [p["tokens_per_s"] for p in results[name]], marker="o", label=name, **style)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("output tokens/s")
    ax.set_title("DFlash verify width vs load (CPU, bundled pair)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=REPO / "deploy/configs/cpu.yaml")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 50])
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--requests", type=int, default=None, help="requests per point (default max(12, C))")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/adaptive_throughput_cpu.json")
    a = ap.parse_args(argv)

    cfg = base_config(a.config)
    prompts = default_prompts(cfg["model"].get("tokenizer") or cfg["model"]["path"], a.prompts)
    levels, widths = sorted(a.concurrency), sorted(a.widths)
    configs = ["no-spec"] + [f"fixed-{b}" for b in widths] + ["adaptive"]
    results: dict[str, list[dict]] = {}
    profile_path = a.out.with_name(a.out.stem + "_profile.json")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in configs[:-1]:
            results[name] = run_config(variant(cfg, name), name, prompts, levels, a.max_new, a.requests, Path(tmp))
        profile = measured_profile(results, widths, levels)
        profile_path.write_text(json.dumps(profile, indent=2) + "\n")
        results["adaptive"] = run_config(variant(cfg, "adaptive", profile_path), "adaptive", prompts, levels,
                                         a.max_new, a.requests, Path(tmp))

    p = acceptance(results[f"fixed-{max(widths)}"])
    predicted = {f"fixed-{b}": [c * expected_tokens(p, b) / profile["seconds"][i][k] if profile["seconds"][i][k] else None
                                for i, c in enumerate(levels)] for k, b in enumerate(widths)}
    md = table(results, levels, configs, predicted)
    print(md)
    png = a.out.with_suffix(".png")
    plot(results, levels, configs, png)
    a.out.write_text(json.dumps({"levels": levels, "widths": widths, "max_new": a.max_new, "acceptance_p": p,
                                 "cost_profile": profile, "predicted_tokens_per_s": predicted, "results": results,
                                 "table": md}, indent=2) + "\n")
    log(f"wrote {a.out}, {png}, {profile_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
