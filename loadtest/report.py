"""Sweep outputs: results.json (source of truth), results.csv, report.md and PNG plots."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

RESULTS = "results.json"
CSV_COLUMNS = ("config", "users", "rate", "ok", "requests", "failures", "failure_ratio", "completed", "output_tok_s",
               "speedup", "window", "req_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
               "tpot_p50_ms", "tpot_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "output_tokens_mean", "accept_length",
               "block_size_shares", "server_ttft_mean_ms", "server_itl_mean_ms", "client_tokenize_p50_ms",
               "goodput_req_s", "slo_met_share", "user_tok_s", "dispatch_delay_p99_ms", "position_acceptance",
               "metrics_from", "error")


def write_results(out: Path, meta: dict, points: list[dict]) -> Path:
    path = out / RESULTS
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"meta": meta, "points": points}, indent=1) + "\n")
    tmp.replace(path)          # atomic: an interrupted sweep never leaves half a file
    return path


def load_results(out: Path) -> tuple[dict, list[dict]]:
    path = out / RESULTS
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run the sweep first (python -m loadtest.sweep --out {out})")
    doc = json.loads(path.read_text())
    return doc["meta"], doc["points"]


def load(p: dict) -> float | None:
    """A point's place on the sweep's axis: its request rate (open loop) or its user count (closed loop)."""
    return p.get("rate") or p.get("users")


def open_loop(points: list[dict]) -> bool:
    return any(p.get("rate") for p in points)


def measured(points: list[dict]) -> list[dict]:
    """Points that produced numbers, with `speedup` over the baseline at the same load."""
    return [p for p in points if p.get("ok") and load(p) is not None]


def add_speedup(points: list[dict], baseline: str | None) -> None:
    base = {load(p): p["output_tok_s"] for p in measured(points) if p["config"] == baseline}
    for p in measured(points):
        b = base.get(load(p))
        p["speedup"] = p["output_tok_s"] / b if b else None


def _get(p: dict, metric: str, stat: str) -> float | None:
    return (p.get(metric) or {}).get(stat)


def row(p: dict) -> dict:
    server = p.get("server") or {}
    return {
        "config": p["config"], "users": p.get("users"), "ok": p.get("ok"), "requests": p.get("requests"),
        "failures": p.get("failures"), "failure_ratio": p.get("failure_ratio"), "completed": p.get("completed"),
        "output_tok_s": p.get("output_tok_s"), "speedup": p.get("speedup"), "window": p.get("window"),
        "req_s": p.get("req_s"),
        **{f"{m}_{q}_ms": _get(p, m, q) for m in ("ttft", "itl", "tpot", "e2e") for q in ("p50", "p99")},
        "output_tokens_mean": _get(p, "output_tokens", "mean"), "accept_length": server.get("accept_length"),
        "block_size_shares": json.dumps(server["block_size_shares"]) if server.get("block_size_shares") else "",
        "server_ttft_mean_ms": server.get("ttft_mean_ms"), "server_itl_mean_ms": server.get("itl_mean_ms"),
        "client_tokenize_p50_ms": _get(p, "client_tokenize", "p50"), "rate": p.get("rate"),
        "goodput_req_s": p.get("goodput_req_s"), "slo_met_share": p.get("slo_met_share"),
        "user_tok_s": p.get("user_tok_s"), "dispatch_delay_p99_ms": (p.get("dispatch_delay_ms") or {}).get("p99"),
        "position_acceptance": json.dumps(server["position_acceptance"]) if server.get("position_acceptance") else "",
        "metrics_from": " ".join(p.get("metrics_from") or []), "error": p.get("error", ""),
    }


def write_csv(out: Path, points: list[dict]) -> Path:
    path = out / "results.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for p in points:
            w.writerow({k: ("" if v is None else v) for k, v in row(p).items()})
    return path


def _num(v: float | None, fmt: str = ".1f") -> str:
    return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def _shares(shares: dict | None) -> str:
    return " ".join(f"{b}:{s:.0%}" for b, s in shares.items()) if shares else ""


def _endpoints(meta: dict) -> str:
    """Which OpenAI endpoints the workload's lines stream (results written before they were recorded: chat)."""
    names = {"/v1/chat/completions": "chat completions", "/v1/completions": "completions (raw prompts, no chat "
             "template)"}
    return " and ".join(names.get(e, e) for e in meta.get("endpoints") or ["/v1/chat/completions"])


def _temperature(meta: dict) -> str:
    per_line = meta.get("line_temperatures")
    return (f"{meta.get('temperature')} where a prompt carries none (the prompts' own: "
            f"{', '.join(format(t, 'g') for t in per_line)})" if per_line else f"{meta.get('temperature')}")


def _client(meta: dict) -> str:
    if not meta.get("client_tokenizer"):
        return ""
    return (f" CPU-heavy client: every user re-tokenizes the text received so far on every streamed chunk with "
            f"the tokenizer in {meta['client_tokenizer']}, in the Locust process on the server's machine (cost: "
            f"\"Client work\" below).")


def _client_table(ok: list[dict]) -> list[str]:
    """The client's own CPU per streamed chunk, where the client did work (chat.py --client-tokenizer)."""
    rows = [p for p in ok if (p.get("client_tokenize") or {}).get("count")]
    if not rows:
        return []
    out = ["", "## Client work (re-tokenizing per streamed chunk)", "",
           "ms per chunk, and the client's tokenizing time over the point's duration (1.00 = one core busy).", "",
           "| config | users | chunks | ms p50 | ms p99 | ms mean | client cores |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for p in rows:
        c = p["client_tokenize"]
        cores = c["mean"] * c["count"] / 1e3 / p["duration_s"] if p.get("duration_s") else None
        out.append(f"| {p['config']} | {load(p):g} | {c['count']} | {_num(c.get('p50'), '.2f')} | "
                   f"{_num(c.get('p99'), '.2f')} | {_num(c.get('mean'), '.2f')} | {_num(cores, '.2f')} |")
    return out


def _slo(meta: dict) -> str:
    parts = [f"TTFT ≤ {meta['slo_ttft_ms']:g} ms" if meta.get("slo_ttft_ms") else "",
             f"TPOT ≤ {meta['slo_tpot_ms']:g} ms" if meta.get("slo_tpot_ms") else ""]
    return " and ".join(x for x in parts if x) or "none set (every completed request counts)"


def sent_rate(meta: dict, p: dict) -> float | None:
    """The request rate the point's measured arrivals were drawn at (the seeded schedule every configuration
    shares): with few arrivals a Poisson draw's rate is not the nominal one."""
    from loadtest.arrivals import realized_rate

    rate = p.get("rate")
    if not rate or not meta.get("arrival"):
        return None
    measured = meta.get("requests") or max(1, round(rate * (meta.get("duration_s") or 0)))
    return realized_rate(rate, meta["arrival"], round(rate * (meta.get("warmup_s") or 0)), measured)


def _positions(ok: list[dict]) -> list[str]:
    """Per-position conditional acceptance, where the server exports it."""
    rows = [p for p in ok if (p.get("server") or {}).get("position_acceptance")]
    if not rows:
        return []
    width = max(len(p["server"]["position_acceptance"]) for p in rows)
    shown = min(width, 16)
    axis = "req/s" if open_loop(ok) else "users"
    out = ["", "## Acceptance by draft position", "",
           "Share of the draft tokens verified at position j (all earlier ones accepted) that were accepted, from "
           "the server's `dflash_accepted_tokens_by_position_total` / `dflash_tried_tokens_by_position_total` "
           f"over the point{'' if width <= shown else f' (first {shown} positions)'}.", "",
           f"| config | {axis} | " + " | ".join(str(j) for j in range(1, shown + 1)) + " |",
           "|---|---:|" + "---:|" * shown]
    for p in rows:
        acc = p["server"]["position_acceptance"]
        out.append(f"| {p['config']} | {load(p):g} | "
                   + " | ".join(_num(acc.get(str(j)), ".2f") for j in range(1, shown + 1)) + " |")
    return out


def markdown(meta: dict, points: list[dict], plots: list[Path]) -> str:
    baseline = meta.get("baseline")
    ok = measured(points)
    per = (f"{meta['duration_s']} s per point" if meta.get("duration_s")
           else f"{meta.get('requests')} requests per point")
    if meta.get("rates"):
        return _markdown_open(meta, points, plots, per)
    lines = [
        f"# DFlash serving sweep{': ' + meta['workload'] if meta.get('workload') else ''}",
        "",
        f"{meta.get('started', '?')} → {meta.get('finished', 'unfinished')}, {meta.get('cpu_count')} CPUs. "
        f"Locust closed loop (`loadtest/chat.py`, streaming {_endpoints(meta)}), {per} after "
        f"{meta.get('warmup')} warm-up requests; max_tokens {meta.get('max_tokens')}, temperature "
        f"{_temperature(meta)}{', ignore_eos' if meta.get('ignore_eos') else ''}, prompts: {meta.get('dataset')}."
        + _client(meta)
        + (" Interleaved: every configuration's server up at once, each point measured for all of them in turn."
           if meta.get("interleave") else " One configuration's points after another's."),
        "",
        "- **output tok/s**: output tokens received per second in the steady-state window, from the moment every "
        "user has finished one request to the moment the first user finished its last (each completed request's "
        "tokens spread over its decode span, so no burst of completions falls in or out of the window whole); "
        "`*` = window too short, measured from the start to the last completion instead.",
        f"- **speedup**: output tok/s over `{baseline}`'s at the same number of users.",
        "- **TTFT / ITL / TPOT** (ms): exact percentiles over all completed requests, measured by the client; ITL "
        "is the gap between streamed chunks (a speculative step can emit several tokens in one chunk), TPOT the "
        "time per output token after the first.",
        "- **accept**: mean tokens per verify step, from the server's `sglang:generation_tokens_total` / "
        "`sglang:spec_verify_calls_total` over the point. **ITL p50** is the point's typical decode step time: the "
        "server streams one chunk per step.",
        "",
        "## Results",
        "",
        "| config | users | output tok/s | speedup | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | TPOT p50 | accept "
        "| done | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in ok:
        s = p.get("server") or {}
        star = "" if p.get("window") == "steady" else "*"
        lines.append(
            f"| {p['config']} | {p['users']} | {_num(p['output_tok_s'])}{star} | "
            f"{_num(p.get('speedup'), '.2f')}{'×' if p.get('speedup') else ''} | "
            f"{_num(_get(p, 'ttft', 'p50'), '.0f')} | {_num(_get(p, 'ttft', 'p99'), '.0f')} | "
            f"{_num(_get(p, 'itl', 'p50'))} | {_num(_get(p, 'itl', 'p99'))} | {_num(_get(p, 'tpot', 'p50'))} | "
            f"{_num(s.get('accept_length'), '.2f')} | {p.get('completed')} | {p.get('failures')} |")
    lines += _client_table(ok)
    lines += _tail(meta, points, plots)
    return "\n".join(lines) + "\n"


def _markdown_open(meta: dict, points: list[dict], plots: list[Path], per: str) -> str:
    """report.md of an open-loop sweep (points at request rates)."""
    baseline = meta.get("baseline")
    ok = measured(points)
    lines = [
        f"# DFlash serving sweep at request rates{': ' + meta['workload'] if meta.get('workload') else ''}",
        "",
        f"{meta.get('started', '?')} → {meta.get('finished', 'unfinished')}, {meta.get('cpu_count')} CPUs. "
        f"Locust open loop (`loadtest/chat.py --rate`, streaming {_endpoints(meta)}): {meta.get('arrival')} "
        f"arrivals at each rate, at most {meta.get('max_in_flight')} requests in flight, {per} of arrivals measured "
        f"after {meta.get('warmup_s'):g} s of unmeasured ones; the same arrival times and prompts for every "
        f"configuration. max_tokens {meta.get('max_tokens')}, temperature {_temperature(meta)}"
        f"{', ignore_eos' if meta.get('ignore_eos') else ''}, prompts: {meta.get('dataset')}." + _client(meta)
        + (" Interleaved: every configuration's server up at once, each point measured for all of them in turn."
           if meta.get("interleave") else " One configuration's points after another's."),
        "",
        f"- **SLO**: {_slo(meta)}. **goodput**: requests/s that completed within it; **met** its share of the "
        "completed requests.",
        "- **sent**: the rate the measured arrivals were drawn at (seeded, the same for every configuration; a "
        "Poisson sample of a few dozen arrivals is not exactly the nominal rate). **req/s, output tok/s**: "
        "requests and output tokens per second between the first and the last measured send (each request's "
        "tokens spread over its decode span, warm-up arrivals still streaming included; every request runs to "
        "its end): below saturation req/s follows `sent`, above it the server's limit.",
        "- **user tok/s**: the median request's decode speed, 1000 / its TPOT: what one user sees while the answer "
        "streams. `pareto.png` plots output tok/s against it: each configuration's curve across the rates.",
        "- **TTFT / ITL / TPOT** (ms): exact percentiles over the measured requests, timed from the moment each was "
        "sent; **late p99**: how long an arrival waited for a free slot of the in-flight cap (0: none did).",
        "- **accept**: mean tokens per verify step, from the servers' counters over the point (behind a router: "
        "the replicas', summed).",
        "",
        "## Results",
        "",
        "| config | req/s offered | sent | req/s | goodput | met | output tok/s | speedup | user tok/s | TTFT p50 | "
        "TTFT p99 | ITL p50 | TPOT p50 | TPOT p99 | late p99 | accept | done | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in ok:
        s = p.get("server") or {}
        late = (p.get("dispatch_delay_ms") or {}).get("p99")
        lines.append(
            f"| {p['config']} | {p['rate']:g} | {_num(sent_rate(meta, p), '.2f')} | {_num(p.get('req_s'), '.2f')} | "
            f"{_num(p.get('goodput_req_s'), '.2f')} "
            f"| {_num(p.get('slo_met_share'), '.0%')} | {_num(p['output_tok_s'])} | "
            f"{_num(p.get('speedup'), '.2f')}{'×' if p.get('speedup') else ''} | {_num(p.get('user_tok_s'))} | "
            f"{_num(_get(p, 'ttft', 'p50'), '.0f')} | {_num(_get(p, 'ttft', 'p99'), '.0f')} | "
            f"{_num(_get(p, 'itl', 'p50'))} | {_num(_get(p, 'tpot', 'p50'))} | {_num(_get(p, 'tpot', 'p99'))} | "
            f"{_num(late, '.0f')} | {_num(s.get('accept_length'), '.2f')} | {p.get('completed')} | "
            f"{p.get('failures')} |")
    if baseline:
        lines.append("")
        lines.append(f"speedup: output tok/s over `{baseline}`'s at the same rate (below saturation every "
                     f"configuration serves the offered rate, so compare user tok/s and TTFT there).")
    lines += _client_table(ok)
    lines += _tail(meta, points, plots)
    return "\n".join(lines) + "\n"


def _tail(meta: dict, points: list[dict], plots: list[Path]) -> list[str]:
    """The sections closed and open sweeps share: widths, positions, comparisons, plots, failures, configs."""
    baseline = meta.get("baseline")
    ok = measured(points)
    axis = "req/s" if open_loop(ok) else "users"
    lines: list[str] = []
    if any((p.get("server") or {}).get("block_size_shares") for p in ok):
        lines += ["", "## Block sizes (share of verify steps)", "", f"| config | {axis} | shares |", "|---|---:|---|"]
        lines += [f"| {p['config']} | {load(p):g} | {_shares(p['server']['block_size_shares'])} |"
                  for p in ok if (p.get("server") or {}).get("block_size_shares")]
    lines += _positions(ok)
    others = list(dict.fromkeys(p["config"] for p in ok if p["config"] != baseline))   # sweep order
    if baseline in {p["config"] for p in ok} and others:
        users = sorted({load(p) for p in ok})
        by = {(p["config"], load(p)): p.get("speedup") for p in ok}
        lines += ["", f"## Speedup over {baseline} (output tok/s)", "",
                  f"| {axis} | " + " | ".join(others) + " |", "|---:|" + "---:|" * len(others)]
        lines += [f"| {u:g} | " + " | ".join(_num(by.get((c, u)), ".2f") for c in others) + " |" for u in users]
    configs = list(dict.fromkeys(p["config"] for p in ok))
    if len(configs) > 1:
        users = sorted({load(p) for p in ok})
        tok = {(p["config"], load(p)): p["output_tok_s"] for p in ok}
        lines += ["", "## Each configuration against the best of the others (output tok/s ratio)", "",
                  f"| {axis} | " + " | ".join(configs) + " |", "|---:|" + "---:|" * len(configs)]
        ratio = {}  # (config, users) -> its tok/s over the best other configuration's at those users
        for u in users:
            for c in configs:
                rest = [tok[(o, u)] for o in configs if o != c and (o, u) in tok]
                if (c, u) in tok and rest:
                    ratio[(c, u)] = tok[(c, u)] / max(rest)
            lines.append(f"| {u:g} | " + " | ".join(_num(ratio.get((c, u)), ".2f") for c in configs) + " |")
        worst = {c: min((r for (k, _), r in ratio.items() if k == c), default=None) for c in configs}
        lines.append("| **worst** | " + " | ".join(_num(worst[c], ".2f") for c in configs) + " |")
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots]
    failed = [p for p in points if not p.get("ok")]
    if failed:
        lines += ["", "## Failed points", ""]
        lines += [f"- {p['config']} {axis} {load(p)}: {p.get('error', '?')[:300]}" for p in failed]
    base = meta.get("base_config")
    lines += ["", "## Configurations", ""] + ([f"Overrides of `{base}`:", ""] if base else [])
    for name, c in meta.get("configs", {}).items():
        override = c.get("override") or {"speculative": (c.get("config") or {}).get("speculative")}
        what = f"server at {c['url']}" if c.get("url") else f"`{json.dumps(override)}`"
        lines.append(f"- `{name}`: {what}")
    return lines


def write_plots(out: Path, points: list[dict], baseline: str | None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")           # files only; no display on servers and CI
    import matplotlib.pyplot as plt

    ok = measured(points)
    configs = list(dict.fromkeys(p["config"] for p in ok))
    if not ok:
        return []
    users = sorted({load(p) for p in ok})
    rates = open_loop(ok)
    colors = {c: plt.get_cmap("tab10")(i % 10) for i, c in enumerate(configs)}

    def series(config: str, get) -> tuple[list, list]:
        pts = sorted((p for p in ok if p["config"] == config and get(p) is not None), key=load)
        return [load(p) for p in pts], [get(p) for p in pts]

    def figure(name: str, title: str, ylabel: str, lines: list[tuple[str, object, str, str]], hline=None) -> Path:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for label, get, style, config in lines:
            x, y = series(config, get)
            if x:
                ax.plot(x, y, style, color=colors[config], label=label, marker="o", markersize=4)
        if hline is not None:
            ax.axhline(hline, color="grey", linewidth=0.8, linestyle=":")
        if len(users) > 1 and not rates:
            ax.set_xscale("log", base=2)
        ax.set_xticks(users, [format(u, "g") for u in users])
        ax.set_xlabel("requests/s offered (open loop)" if rates else "concurrent users")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    made = [
        figure("throughput", "Output tokens/s", "tokens/s",
               [(c, lambda p: p["output_tok_s"], "-", c) for c in configs]),
        figure("ttft", "Time to first token (solid p50, dashed p99)", "ms",
               [(f"{c} {q}", (lambda q: lambda p: _get(p, "ttft", q))(q), s, c)
                for c in configs for q, s in (("p50", "-"), ("p99", "--"))]),
        figure("itl", "Inter-token latency per chunk (solid p50, dashed p99)", "ms",
               [(f"{c} {q}", (lambda q: lambda p: _get(p, "itl", q))(q), s, c)
                for c in configs for q, s in (("p50", "-"), ("p99", "--"))]),
    ]
    others = [c for c in configs if c != baseline]
    if baseline in configs and others:
        made.append(figure("speedup", f"Output tokens/s speedup over {baseline}", "×",
                           [(c, lambda p: p.get("speedup"), "-", c) for c in others], hline=1.0))
    if any(p.get("goodput_req_s") is not None for p in ok) and rates:
        made.append(figure("goodput", "Requests/s within the SLOs (solid) and completed (dashed)", "requests/s",
                           [(f"{c} {what}", get, style, c) for c in configs
                            for what, get, style in (("goodput", lambda p: p.get("goodput_req_s"), "-"),
                                                     ("req/s", lambda p: p.get("req_s"), "--"))]))
    if any(p.get("user_tok_s") for p in ok):
        made.append(pareto(out, ok, configs, colors, plt, rates))
    if any((p.get("server") or {}).get("accept_length") for p in ok):
        made.append(figure("acceptance", "Mean tokens per verify step", "tokens",
                           [(c, lambda p: (p.get("server") or {}).get("accept_length"), "-", c) for c in configs]))
    return made


def pareto(out: Path, ok: list[dict], configs: list[str], colors: dict, plt, rates: bool) -> Path:
    """Total output tok/s against one user's tok/s, a curve per configuration across the sweep's loads: up and
    to the right is better; each point is labelled with its load."""
    fig, ax = plt.subplots(figsize=(7, 4.6))
    for c in configs:
        pts = sorted((p for p in ok if p["config"] == c and p.get("user_tok_s")), key=load)
        if not pts:
            continue
        x, y = [p["user_tok_s"] for p in pts], [p["output_tok_s"] for p in pts]
        ax.plot(x, y, "-", color=colors[c], label=c, marker="o", markersize=4)
        for p, xi, yi in zip(pts, x, y):
            ax.annotate(f"{load(p):g}{'/s' if rates else 'u'}", (xi, yi), fontsize=7, xytext=(3, 3),
                        textcoords="offset points", color=colors[c])
    ax.set_xlabel("tokens/s per user (median request: 1000 / TPOT)")
    ax.set_ylabel("output tokens/s, all users")
    ax.set_title("Throughput against per-user speed (" + ("labels: req/s offered)" if rates else "labels: users)"))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "pareto.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(out: Path) -> list[Path]:
    """results.csv, the plots and report.md from results.json; returns what it wrote."""
    meta, points = load_results(out)
    add_speedup(points, meta.get("baseline"))
    plots = write_plots(out, points, meta.get("baseline"))
    path = out / "report.md"
    path.write_text(markdown(meta, points, plots))
    return [write_csv(out, points), *plots, path]
