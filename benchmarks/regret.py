"""Regret per request: the same prompts through plain decoding, each fixed width and dflash_adaptive, side by side.

Every configuration gets its own server (the CPU default pair); for each prompt of a workload, one request to every
server in turn (one user: the order rotates every prompt, so the machine's drift falls on all), in the same prompt
order on every server -- so dflash_adaptive sees the sequence a real server would, cold start included. Per request
and server: output tokens/s over the whole request (what the user waits for), verify steps and tokens per step
(`meta_info.spec_verify_ct`). Per request, adaptive's tokens/s over the best fixed width's for that prompt (the
*regret ratio*) and over max(no-spec, best fixed). Greedy outputs are compared across servers for free: a speculative
server that answers differently from plain decoding is a bug, and is reported.

    python benchmarks/regret.py [--workloads realcode code prose] [--limit 32] [--max-tokens 128]
        [--fixed 2 4 8 16] [--config deploy/configs/cpu.yaml] [--adaptive-set KEY=VALUE ...]
        [--out benchmarks/results/regret_cpu.json]

Workloads: realcode (loadtest/prompts/realcode.jsonl, raw completions, greedy: real code the pair never saw),
code (the code mix, chat template, greedy), prose (chat template, temperature 1). Prints a markdown table per
workload (the distribution of regret ratios, the share of requests > 10 % worse than their best fixed width) and
writes JSON with every request.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.step_time import server_config  # noqa: E402
from harness.server import ManagedServer, http_json  # noqa: E402
from loadtest import server_metrics  # noqa: E402

PROMPTS = REPO / "loadtest" / "prompts"
WORKLOADS = {  # name -> (file, temperature)
    "realcode": (PROMPTS / "realcode.jsonl", 0.0),
    "code": (PROMPTS / "mix.jsonl", 0.0),
    "prose": (PROMPTS / "prose.jsonl", 1.0),
}
ADAPTIVE = "adaptive"


def texts(path: Path, tokenizer) -> list[str]:
    """Each line as the text the server decodes from: a raw prompt as is, chat messages through the template."""
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        obj = json.loads(line)
        if "prompt" in obj:
            out.append(obj["prompt"])
        else:
            msgs = [m for m in obj["messages"] if m["role"] != "assistant"]
            out.append(tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    return out


def _set(cfg: dict, assignment: str) -> None:
    """KEY=VALUE into speculative.adaptive (VALUE parsed as YAML)."""
    import yaml

    key, _, value = assignment.partition("=")
    cfg["speculative"].setdefault("adaptive", {})[key] = yaml.safe_load(value)


def configs(base: Path, fixed: list[int], adaptive_set: list[str]) -> dict[str, dict]:
    out = {"no-spec": server_config(base, speculative=False)}
    for b in fixed:
        cfg = server_config(base, speculative=True)
        cfg["speculative"] = {**cfg["speculative"], "algorithm": "dflash", "block_size": b}
        cfg["speculative"].pop("adaptive", None)
        out[f"b{b}"] = cfg
    cfg = server_config(base, speculative=True)
    cfg["speculative"] = {k: v for k, v in cfg["speculative"].items() if k != "block_size"}
    cfg["speculative"]["algorithm"] = "dflash_adaptive"
    for a in adaptive_set:
        _set(cfg, a)
    out[ADAPTIVE] = cfg
    return out


def _widths(server: ManagedServer) -> dict[str, float]:
    return {labels["block_size"]: v for labels, v in
            server_metrics.parse(server.metrics()).get(server_metrics.BLOCK_STEPS, [])}


def ask(server: ManagedServer, text: str, temperature: float, max_tokens: int, repeats: int = 1,
        widths: bool = False) -> dict:
    """One prompt `repeats` times; the fastest run's time (the least disturbed by the rest of the machine)."""
    params = {"max_new_tokens": max_tokens, "temperature": temperature}
    before = _widths(server) if widths else {}
    best = None
    for _ in range(repeats):
        t = time.perf_counter()
        r = http_json(f"{server.url}/generate", {"text": text, "sampling_params": params}, timeout=600)
        e2e = time.perf_counter() - t
        meta = r["meta_info"]
        tokens = meta["completion_tokens"]
        steps = meta.get("spec_verify_ct") or 0
        run = {"tokens": tokens, "e2e_s": e2e, "tps": tokens / e2e, "steps": steps,
               "per_step": tokens / steps if steps else None, "text": r["text"]}
        if best is None or run["tps"] > best["tps"]:
            best = run
    if widths:  # the adaptive server's steps by width over the repeats
        after = _widths(server)
        best["steps_by_width"] = {w: int(v - before.get(w, 0.0)) for w, v in sorted(after.items(), key=lambda x: int(x[0]))
                                  if v - before.get(w, 0.0) > 0}
    return best


def summarize(rows: list[dict], names: list[str], greedy: bool) -> dict:
    fixed = [n for n in names if n.startswith("b")]
    ratios_fixed, ratios_all, tps = [], [], {n: [] for n in names}
    mismatches = {n: 0 for n in names}
    for row in rows:
        res = row["results"]
        for n in names:
            tps[n].append(res[n]["tps"])
            if greedy and res[n]["text"] != res["no-spec"]["text"]:
                mismatches[n] += 1
        best_fixed = max(res[n]["tps"] for n in fixed)
        row["best_fixed"] = max(fixed, key=lambda n: res[n]["tps"])
        row["regret_vs_best_fixed"] = res[ADAPTIVE]["tps"] / best_fixed
        row["regret_vs_best"] = res[ADAPTIVE]["tps"] / max(best_fixed, res["no-spec"]["tps"])
        ratios_fixed.append(row["regret_vs_best_fixed"])
        ratios_all.append(row["regret_vs_best"])

    def dist(xs: list[float]) -> dict:
        q = statistics.quantiles(xs, n=10, method="inclusive") if len(xs) > 1 else xs * 9
        return {"min": min(xs), "p10": q[0], "median": statistics.median(xs), "p90": q[8], "max": max(xs),
                "share_worse_10pct": sum(x < 0.9 for x in xs) / len(xs)}

    # the aggregate a throughput benchmark would see: total tokens over total time, per server
    agg = {n: sum(r["results"][n]["tokens"] for r in rows) / sum(r["results"][n]["e2e_s"] for r in rows)
           for n in names}
    return {"requests": len(rows), "vs_best_fixed": dist(ratios_fixed), "vs_best": dist(ratios_all),
            "aggregate_tps": agg, "greedy_mismatches": mismatches if greedy else None,
            "per_step_median": {n: statistics.median([r["results"][n]["per_step"] or 1.0 for r in rows])
                                for n in names}}


def table(name: str, s: dict, names: list[str]) -> str:
    a = s["aggregate_tps"]
    best = max(a[n] for n in names if n != ADAPTIVE)
    lines = [f"### {name} ({s['requests']} requests)", "",
             "| | min | p10 | median | p90 | > 10 % worse |", "|---|---:|---:|---:|---:|---:|"]
    for key, label in (("vs_best_fixed", "adaptive / best fixed width, per request"),
                       ("vs_best", "adaptive / max(no-spec, best fixed), per request")):
        d = s[key]
        lines.append(f"| {label} | {d['min']:.2f} | {d['p10']:.2f} | {d['median']:.2f} | {d['p90']:.2f} "
                     f"| {100 * d['share_worse_10pct']:.0f} % |")
    lines += ["", "| server | tokens/s (all requests) | / best other | median tokens per step |",
              "|---|---:|---:|---:|"]
    for n in names:
        lines.append(f"| {n} | {a[n]:.1f} | {a[n] / best:.2f} | {s['per_step_median'][n]:.2f} |")
    if s["greedy_mismatches"] and any(s["greedy_mismatches"].values()):
        lines.append(f"\n**greedy output differs from plain decoding:** {s['greedy_mismatches']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=REPO / "deploy/configs/cpu.yaml", help="base server config")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--limit", type=int, default=32, help="prompts per workload (spread over the file)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=1, help="runs per prompt and server; the fastest counts")
    p.add_argument("--fixed", type=int, nargs="+", default=[2, 4, 8, 16], help="upstream dflash block sizes")
    p.add_argument("--adaptive-set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="speculative.adaptive overrides for the adaptive server (e.g. probe settings)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/regret_cpu.json")
    a = p.parse_args(argv)
    from transformers import AutoTokenizer

    cfgs = configs(a.config, a.fixed, a.adaptive_set)
    names = list(cfgs)
    tok = AutoTokenizer.from_pretrained(cfgs["no-spec"]["model"]["path"])
    result = {"command": " ".join(sys.argv), "max_tokens": a.max_tokens, "configs": cfgs, "workloads": {}}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        servers = {n: stack.enter_context(ManagedServer(c, Path(tmp), n)) for n, c in cfgs.items()}
        for wl in a.workloads:
            path, temperature = WORKLOADS[wl]
            all_texts = texts(path, tok)
            step = max(1, len(all_texts) // a.limit)
            chosen = all_texts[::step][:a.limit]
            for s in servers.values():  # warm-up: first-request costs (compilation, allocations) out of the rows
                ask(s, chosen[0], temperature, 8)
            rows = []
            for i, text in enumerate(chosen):
                order = names[i % len(names):] + names[:i % len(names)]
                res = {n: ask(servers[n], text, temperature, a.max_tokens, a.repeats, widths=n == ADAPTIVE)
                       for n in order}
                rows.append({"prompt_index": i * step, "results": res})
                r = res[ADAPTIVE]
                best = max((n for n in names if n.startswith("b")), key=lambda n: res[n]["tps"])
                print(f"[{wl} {i + 1}/{len(chosen)}] adaptive {r['tps']:.1f} tok/s ({r['per_step'] or 1:.2f}/step)"
                      f" best fixed {best} {res[best]['tps']:.1f} ({res[best]['per_step'] or 1:.2f}/step)"
                      f" no-spec {res['no-spec']['tps']:.1f} widths {r.get('steps_by_width')}", flush=True)
            s = summarize(rows, names, greedy=temperature == 0)
            for row in rows:
                for r in row["results"].values():
                    r.pop("text")
            result["workloads"][wl] = {"summary": s, "rows": rows}
            print(table(wl, s, names), flush=True)
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
