"""Regret per request without the machine's noise: the real controller replayed over the bundled pair's real
acceptance, against every fixed width, on a step-cost table.

Why: per-request tokens/s through live servers on a shared 2-core machine swing by 2x between identical requests,
which hides what the controller decides; the decisions are deterministic given what the steps accept. This replays
them exactly: greedy decoding is plain decoding's output whatever the width, so what a draft at stream position p
accepts is known for every width before any policy runs (benchmarks/tree_shape_offline.py does the same for trees).

How: per prompt, plain greedy decoding with the target (transformers, stopping at EOS or --max-new as the server
does) gives the committed sequence. At every position p (anchor = the token at p, context = the target's features of
positions < p, as the worker drafts) the drafter drafts its full block of 16 and, for each prefix width b < 16, a
block of b positions (on CPU the worker drafts only the b positions a width verifies, and a DFlash drafter attends
within its block both ways, so the b-block is not the 16-block's prefix). R_b[p] = the draft's leading run of tokens
equal to the sequence's. Then the requests run one after another through ONE BlockSizeController (as a server's
would see them, batch size 1), each step as the worker runs it: decide -> width b, full draft or not, probe ->
accepted = min(R, b - 1) from the 16-block when the step drafts the full block, else from the b-block; the drafted
block goes to hindsight when drafted in full; the step's time from the cost table goes to the cost learner (as
measured step times do). Fixed widths: upstream's block b drafts b positions and verifies them every step.

Costs (ms per step at one request, --costs FILE.json or the defaults below): `none` a plain decode step; `w1` the
adaptive worker's width-1 step; `prefix<b>` its step at width b drafting b positions; `full` its step at 16;
`probe_extra` what a full draft adds to a narrower step; `fixed<b>` upstream's block-b step.

    python benchmarks/regret_offline.py [--workloads realcode code] [--limit 96] [--max-new 128]
        [--set KEY=VALUE ...] [--costs FILE.json] [--traces benchmarks/results/regret_traces.npz]
        [--new-tokens 32 64] [--moderate]

Prints a markdown table per workload and writes JSON (--out).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.regret import WORKLOADS  # noqa: E402
from sglang_ext.controller.config import ControllerConfig  # noqa: E402
from sglang_ext.controller.cost_model import CostModel  # noqa: E402
from sglang_ext.controller.policy import BlockSizeController  # noqa: E402

FILES = {name: path for name, (path, _) in WORKLOADS.items()}  # greedy here whatever the live temperature
WIDTHS = (1, 2, 4, 8, 16)
# ms per step at one request on the project's 2-core CPU, from the step profiles in benchmarks/results/
# (step_profile_cpu*.json: none, w1, prefix8, full, fixed8; step_time_cpu.json: fixed16); widths 2 and 4 and the
# full draft's extra are interpolated between them. --costs passes a fresh table.
DEFAULT_COSTS = {"none": 8.7, "w1": 9.5, "prefix2": 12.0, "prefix4": 13.3, "prefix8": 15.9, "full": 18.8,
                 "probe_extra": 4.5, "fixed2": 11.5, "fixed4": 12.6, "fixed8": 14.3, "fixed16": 18.5}


# -- traces ---------------------------------------------------------------------------------------------------
def prompt_ids(tok, path: Path) -> list[list[int]]:
    """Each line's token ids, as the live benchmark sends its text (benchmarks/regret.py `texts`)."""
    from benchmarks.regret import texts

    return [tok.encode(t, add_special_tokens=False) for t in texts(path, tok)]


def trace(target, drafter, ids: list[int], max_new: int, eos: int | None) -> dict[str, np.ndarray]:
    """One prompt: the greedy output and R_b at every anchor position (anchors from the prompt's last token)."""
    import torch

    from dflash_models.train_drafter import target_features

    B = drafter.block_size
    with torch.no_grad():
        out = target(input_ids=torch.tensor([ids]), use_cache=True)
        seq = list(ids)
        for _ in range(max_new):
            nxt = int(out.logits[0, -1].argmax())
            seq.append(nxt)
            if nxt == eos:
                break
            out = target(input_ids=torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
        t = torch.tensor(seq)
        pad = torch.cat([t, torch.full((B,), -1)])  # positions past the end never match
        anchors = torch.arange(len(ids) - 1, len(seq) - 1)
        feats = target_features(target, t[None], drafter.target_layer_ids)
        embed, head = target.get_input_embeddings(), target.get_output_embeddings().weight
        runs, full_tokens = {}, None
        for b in WIDTHS[1:]:
            drafter.block_size = b
            try:
                hidden = drafter(feats, t[None], anchors[None], embed)[0]  # [N, b, H]
            finally:
                drafter.block_size = B
            drafted = (hidden[:, 1:] @ head.T).argmax(-1)  # [N, b - 1]
            cont = torch.stack([pad[p + 1: p + b] for p in anchors.tolist()])
            runs[b] = (drafted == cont).int().cumprod(dim=1).sum(dim=1).numpy()
            if b == B:
                full_tokens = drafted.numpy()
    return {"seq": np.asarray(seq), "start": len(ids) - 1, **{f"R{b}": r for b, r in runs.items()},
            "drafted": full_tokens}


def build_traces(workloads: list[str], limit: int, max_new: int) -> dict[str, list[dict]]:
    from transformers import AutoTokenizer

    from benchmarks.tree_shape_offline import load_pair

    target, drafter = load_pair()
    tok = AutoTokenizer.from_pretrained(REPO / "models/tiny-code/target")
    out = {}
    for wl in workloads:
        ids = prompt_ids(tok, FILES[wl])
        step = max(1, len(ids) // limit)
        chosen = ids[::step][:limit]
        out[wl] = []
        for i, p in enumerate(chosen):
            out[wl].append(trace(target, drafter, p, max_new, tok.eos_token_id))
            print(f"[traces {wl}] {i + 1}/{len(chosen)}", file=sys.stderr, flush=True)
    return out


def save_traces(path: Path, traces: dict[str, list[dict]]) -> None:
    flat = {f"{wl}/{i}/{k}": v for wl, rows in traces.items() for i, r in enumerate(rows) for k, v in r.items()}
    np.savez_compressed(path, **flat)


def load_traces(path: Path) -> dict[str, list[dict]]:
    data = np.load(path)
    out: dict[str, dict[int, dict]] = {}
    for key in data.files:
        wl, i, k = key.split("/")
        out.setdefault(wl, {}).setdefault(int(i), {})[k] = data[key] if k != "start" else int(data[key])
    return {wl: [rows[i] for i in sorted(rows)] for wl, rows in out.items()}


# -- replay ---------------------------------------------------------------------------------------------------
def fixed_time(tr: dict, b: int, costs: dict) -> tuple[float, int]:
    """(ms, steps) of upstream's block b (b = 1: plain decoding) over one request."""
    p, end = tr["start"], stream_end(tr)
    ms, steps = 0.0, 0
    while p < end:
        acc = 0 if b == 1 else min(int(tr[f"R{b}"][p - tr["start"]]), b - 1)
        p += min(acc + 1, end - p)
        ms += costs["none"] if b == 1 else costs[f"fixed{b}"]
        steps += 1
    return ms, steps


def step_cost(b: int, full: bool, probe: bool, costs: dict) -> float:
    if b == 1:
        return costs["w1"] + (costs["probe_extra"] if full else 0.0)
    if b == 16:
        return costs["full"]
    return costs[f"prefix{b}"] + (costs["probe_extra"] if full else 0.0)


# Where a request's steps went (adaptive_times): width 1 before the request's first full draft (the cold start: its
# width comes from its class's estimate alone), width 1 after it, probes, and steps at a wider width.
PHASES = ("cold_w1", "w1", "probe", "wide")


def adaptive_times(traces: list[dict], cfg: ControllerConfig, costs: dict, rid0: int = 0) -> list[dict]:
    """Every request in turn through one controller; per request its ms, steps and steps by width, and per phase
    (PHASES) its ms and committed tokens."""
    cost = CostModel.default(list(cfg.candidates_for(16)), ema=cfg.cost_ema)
    ctl = BlockSizeController(cfg, cost, max_block=16, prefix_drafts=True)
    out = []
    for n, tr in enumerate(traces):
        rid = f"r{rid0 + n}"
        seq, p, end = tr["seq"], tr["start"], stream_end(tr)
        ms, by_width, probes = 0.0, {}, 0
        phase_ms, phase_tokens = dict.fromkeys(PHASES, 0.0), dict.fromkeys(PHASES, 0)
        drafted_full, overhead = False, 0.0
        while p < end:
            d = ctl.decide([rid])
            b, full = d.block_size, d.draft_full
            i = p - tr["start"]
            acc = min(int(tr["R16"][i] if full or b == 16 else (tr[f"R{b}"][i] if b > 1 else 0)), b - 1)
            acc = min(acc, len(seq) - p - 2)  # what the verify accepted: a request's token limit cuts it later
            committed = [seq[p + 1: p + acc + 2].tolist()]
            drafted = tr["drafted"][i][None, :] if full else None
            ctl.observe_step([rid], b, [acc], drafted, committed)
            t = step_cost(b, full, d.probe, costs)
            ctl.observe_step_time(1, b, t / 1e3, probe=d.probe)
            if ctl.cost_sync_due:
                ctl.sync_cost_table()
            ms += t
            by_width[b] = by_width.get(b, 0) + 1
            probes += d.probe
            phase = "probe" if d.probe else "wide" if b > 1 else "w1" if drafted_full else "cold_w1"
            phase_ms[phase] += t
            if phase == "wide":  # what the same width costs upstream: the rest of the phase's loss is the decisions'
                overhead += t - costs[f"fixed{b}"]
            phase_tokens[phase] += min(acc + 1, end - p)
            drafted_full |= full
            p += acc + 1
        ctl.finish(rid)
        out.append({"ms": ms, "steps_by_width": by_width, "probes": probes, "phase_ms": phase_ms,
                    "phase_tokens": phase_tokens, "wide_overhead_ms": overhead})
    return out


def known_width(tr: dict, costs: dict) -> int:
    """The fixed width a controller would run all along if it knew, before the request's first step, what a draft
    accepts at every position of it (its mean over the whole output, each width's own draft) and upstream's step
    costs: the best a decision from acceptance alone can do, without knowing where in the output each step lands.
    Why: each request's best fixed width is found in hindsight, by the steps' positions as they fell; how far this
    width stays from it is what no decision from acceptance alone can win back."""
    i = slice(0, stream_end(tr) - tr["start"])
    return max(WIDTHS[1:], key=lambda b: (np.minimum(tr[f"R{b}"][i], b - 1).mean() + 1.0) / costs[f"fixed{b}"])


def stream_end(tr: dict) -> int:
    """The stream position of a request's last token (``cut``: its token limit)."""
    return min(tr.get("end", len(tr["seq"]) - 1), len(tr["seq"]) - 1)


def cut(tr: dict, new_tokens: int) -> dict:
    """The trace of the same prompt asked for at most ``new_tokens`` tokens: greedy, its output is the prefix of the
    longer one's, and what a draft at each position accepts is unchanged. As in a server, a verify accepts past the
    limit (the controller observes what it accepted) and the request keeps only the tokens up to it."""
    return {**tr, "end": tr["start"] + new_tokens}


def full_block_tokens(tr: dict) -> float:
    """Tokens per step of upstream's full block (16) over the request: how well the drafter guesses it."""
    return (stream_end(tr) - tr["start"]) / fixed_time(tr, 16, {"fixed16": 1.0})[1]


def report(wl: str, traces: list[dict], cfg: ControllerConfig, costs: dict) -> dict:
    tokens = [stream_end(t) - t["start"] for t in traces]
    fixed = {b: [fixed_time(t, b, costs)[0] for t in traces] for b in WIDTHS}
    ad = adaptive_times(traces, cfg, costs)
    rows = []
    for i, t in enumerate(traces):
        best_b = min(WIDTHS[1:], key=lambda b: fixed[b][i])
        known_b = known_width(t, costs)
        best_all = min(fixed[1][i], fixed[best_b][i])
        rows.append({"tokens": tokens[i], "adaptive_ms": ad[i]["ms"], "best_fixed": best_b,
                     "vs_best_fixed": fixed[best_b][i] / ad[i]["ms"], "vs_best": best_all / ad[i]["ms"],
                     "steps_by_width": ad[i]["steps_by_width"], "probes": ad[i]["probes"],
                     "tau16": float(np.mean(t["R16"])) + 1.0, "full_block_tokens": full_block_tokens(t),
                     "phase_ms": ad[i]["phase_ms"], "phase_tokens": ad[i]["phase_tokens"],
                     "wide_overhead_ms": ad[i]["wide_overhead_ms"],
                     "best_fixed_ms": fixed[best_b][i], "known_width": known_b,
                     "known_vs_best_fixed": fixed[best_b][i] / fixed[known_b][i]})
    total = {("none" if b == 1 else f"b{b}"): sum(tokens) / sum(fixed[b]) * 1e3 for b in WIDTHS}
    total["adaptive"] = sum(tokens) / sum(r["adaptive_ms"] for r in rows) * 1e3
    return {"rows": rows, "tokens_per_s": total, "vs_best_fixed": dist([r["vs_best_fixed"] for r in rows]),
            "vs_best": dist([r["vs_best"] for r in rows]), "lost": lost(rows),
            "known_vs_best_fixed": dist([r["known_vs_best_fixed"] for r in rows]),
            "tokens_per_step": {"adaptive": sum(tokens) / sum(sum(r["steps_by_width"].values()) for r in rows),
                                "full_block": sum(tokens) / sum(fixed_time(t, 16, costs)[1] for t in traces)}}


def lost(rows: list[dict]) -> dict:
    """Adaptive's time over each request's best fixed width, split by phase (PHASES): a phase's ms less what its
    committed tokens took at the best fixed width's mean time per token, summed over the requests, as a share of the
    best fixed widths' total time. The shares add up to adaptive's total over the best fixed widths' (less 1).
    ``wide_step_cost``: the part of ``wide`` that is adaptive's step costing more than upstream's at the same width."""
    base = sum(r["best_fixed_ms"] for r in rows)
    out = {}
    for ph in PHASES:
        out[ph] = sum(r["phase_ms"][ph] - r["phase_tokens"][ph] * r["best_fixed_ms"] / r["tokens"] for r in rows) / base
    out["wide_step_cost"] = sum(r["wide_overhead_ms"] for r in rows) / base
    return out


def dist(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=10, method="inclusive")
    return {"min": min(xs), "p10": q[0], "median": statistics.median(xs), "p90": q[8], "max": max(xs),
            "share_worse_10pct": sum(x < 0.9 for x in xs) / len(xs)}


def table(wl: str, r: dict) -> str:
    lines = [f"### {wl} ({len(r['rows'])} requests, offline replay)", "",
             "| | min | p10 | median | p90 | > 10 % worse |", "|---|---:|---:|---:|---:|---:|"]
    for key, label in (("vs_best_fixed", "adaptive / best fixed width"), ("vs_best", "adaptive / best of all"),
                       ("known_vs_best_fixed", "width known ahead / best fixed width")):
        d = r[key]
        lines.append(f"| {label} | {d['min']:.2f} | {d['p10']:.2f} | {d['median']:.2f} | {d['p90']:.2f} | "
                     f"{100 * d['share_worse_10pct']:.0f} % |")
    lines += ["", "Time over each request's best fixed width, by phase (share of the best fixed widths' time; "
              "negative: faster): " + ", ".join(f"{ph} {100 * v:+.1f} %" for ph, v in r["lost"].items())
              + f"; tokens per step: adaptive {r['tokens_per_step']['adaptive']:.2f}, "
              f"full block {r['tokens_per_step']['full_block']:.2f}"]
    tps = r["tokens_per_s"]
    best = max(v for k, v in tps.items() if k != "adaptive")
    lines += ["", "| " + " | ".join(tps) + " |", "|" + "---:|" * len(tps),
              "| " + " | ".join(f"{v:.1f} ({v / best:.2f})" for v in tps.values()) + " |"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", nargs="+", default=["realcode", "code"], choices=list(FILES))
    p.add_argument("--limit", type=int, default=96)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--traces", type=Path, default=REPO / "benchmarks/results/regret_traces.npz",
                   help="cached traces (built when missing or --rebuild)")
    p.add_argument("--rebuild", action="store_true")
    p.add_argument("--costs", type=Path, help="JSON {name: ms} overriding the default step costs")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="ControllerConfig overrides")
    p.add_argument("--new-tokens", type=int, nargs="+", default=[],
                   help="also replay every request cut to these many new tokens (short requests)")
    p.add_argument("--moderate", action="store_true",
                   help="only requests the full block serves at 1.5-3 tokens a step (moderate acceptance)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/regret_offline_cpu.json")
    a = p.parse_args(argv)
    import yaml

    traces = {} if a.rebuild or not a.traces.exists() else load_traces(a.traces)
    missing = [wl for wl in a.workloads if wl not in traces]
    if missing:
        traces |= build_traces(missing, a.limit, a.max_new)
        save_traces(a.traces, traces)
    costs = {**DEFAULT_COSTS, **(json.loads(a.costs.read_text()) if a.costs else {})}
    overrides = {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in a.set)}
    cfg = ControllerConfig(**overrides)
    result = {"command": " ".join(sys.argv), "costs_ms": costs, "controller": overrides, "workloads": {}}
    for wl in a.workloads:
        for n in [None, *a.new_tokens]:
            rows = traces[wl] if n is None else [cut(t, n) for t in traces[wl]]
            if a.moderate:
                rows = [t for t in rows if 1.5 <= full_block_tokens(t) <= 3.0]
            if not rows:
                continue
            name = wl if n is None else f"{wl}@{n}"
            r = report(name, rows, cfg, costs)
            result["workloads"][name] = r
            print(table(name, r))
    a.out.write_text(json.dumps(result, indent=1, default=int) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
