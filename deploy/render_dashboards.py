"""Render the Grafana dashboards' panels from Prometheus data as PNG pictures (matplotlib), without Grafana.

Each dashboard of deploy/grafana/dashboards becomes one PNG with its panels where Grafana puts them (gridPos);
every panel runs its own PromQL with the template variables filled in as Grafana would. A panel without data
says "no data" -- the picture shows exactly what Grafana would show empty.

    # from a running Prometheus (the compose stack's, or any scraping dflash-serve)
    python3 -m deploy.render_dashboards --prometheus http://127.0.0.1:9090 --since 15m --out /tmp/dash
    # self-contained: start the CPU compose config's server and a local Prometheus, run a chat load, render
    python3 -m deploy.render_dashboards --demo --out docs/ --load-seconds 90 --phases 1,4,8
"""
from __future__ import annotations

import argparse
import io
import math
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `deploy` and `service` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy import promstack

REPO = Path(__file__).resolve().parents[1]
GRID_COLUMNS = 24
COLORS = ["#7eb26d", "#eab839", "#6ed0e0", "#ef843c", "#e24d42", "#1f78c1", "#ba43a9", "#705da0",
          "#508642", "#cca300", "#447ebc", "#c15c17", "#890f02", "#0a437c", "#6d1f62", "#584477"]


# ------------------------------------------------------------------------------------------------ units
def fmt_value(v: float, unit: str | None, decimals: int | None = None) -> str:
    if v is None or not math.isfinite(v):
        return "NaN"
    d = 2 if decimals is None else decimals
    if unit == "s":
        if abs(v) < 1e-3:
            return f"{v * 1e6:.0f} µs"
        if abs(v) < 1:
            return f"{v * 1e3:.{min(d, 1)}f} ms"
        return f"{v:.{d}f} s"
    if unit == "percentunit":
        return f"{v * 100:.{1 if decimals is None else decimals}f}%"
    if unit == "reqps":
        return f"{v:.{d}f} req/s"
    if abs(v) >= 1e4:
        return f"{v / 1e3:.1f}k"
    if decimals is None and float(v).is_integer():
        return f"{v:.0f}"
    return f"{v:.{d}f}"


def _axis_formatter(unit: str | None):
    from matplotlib.ticker import FuncFormatter

    if unit == "s":
        return FuncFormatter(lambda v, _: f"{v * 1e3:.0f} ms" if abs(v) < 1 else f"{v:.1f} s")
    if unit == "percentunit":
        return FuncFormatter(lambda v, _: f"{v * 100:.0f}%")
    return None


# ------------------------------------------------------------------------------------------------ data
def fetch_panel(panel: dict, client: promstack.PromClient, variables: dict, start: float, end: float,
                step: float, rate_interval: str) -> list[tuple[str, dict, list[tuple[float, float]]]]:
    """[(legend, labels, [(t, v)])] for each series of each target of `panel`."""
    out = []
    range_ = f"{max(1, int(end - start))}s"
    for t in panel.get("targets", []):
        if t.get("hide"):
            continue
        expr = promstack.substitute(t["expr"], variables, rate_interval=rate_interval, range_=range_,
                                    interval=f"{step:g}s")
        try:
            if t.get("instant") and not t.get("range", False):
                result = [{"metric": r["metric"], "values": [r["value"]]} for r in client.query(expr, end)]
            else:
                result = client.query_range(expr, start, end, step)
        except promstack.PrometheusError as e:
            print(f"render: {panel['title']} {t['refId']}: {e}", file=sys.stderr)
            continue
        for r in result:
            points = [(float(ts), float(v)) for ts, v in r["values"]]
            out.append((promstack.legend(t.get("legendFormat", ""), r["metric"], t["refId"]), r["metric"], points))
    return out


# ------------------------------------------------------------------------------------------------ drawing
def _no_data(ax, text: str = "no data") -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", color="#999999", fontsize=11, transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def draw_timeseries(ax, panel: dict, series, start: float, end: float) -> None:
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    unit = defaults.get("unit")
    custom = defaults.get("custom", {})
    stacked = custom.get("stacking", {}).get("mode") == "normal"
    stepped = custom.get("lineInterpolation") == "stepAfter"
    series = [(name, [(t, v) for t, v in pts if math.isfinite(v)]) for name, _, pts in series]
    series = [(name, pts) for name, pts in series if pts]
    if not series:
        return _no_data(ax)
    series.sort(key=lambda s: _natural_key(s[0]))
    if stacked:
        times = sorted({t for _, pts in series for t, _ in pts})
        base = [0.0] * len(times)
        for i, (name, pts) in enumerate(series):
            d = dict(pts)
            top = [b + d.get(t, 0.0) for b, t in zip(base, times)]
            x = [t - end for t in times]
            ax.fill_between(x, base, top, step="post" if stepped else None, alpha=0.6,
                            color=COLORS[i % len(COLORS)], label=name, linewidth=0)
            base = top
    else:
        for i, (name, pts) in enumerate(series):
            x, y = _with_gaps(pts, end)
            kw = {"color": COLORS[i % len(COLORS)], "label": name, "linewidth": 1.2}
            if stepped:
                ax.step(x, y, where="post", **kw)
            else:
                ax.plot(x, y, **kw)
    if "min" in defaults:
        ax.set_ylim(bottom=defaults["min"])
    if "max" in defaults:
        ax.set_ylim(top=defaults["max"])
    ax.set_xlim(start - end, 0)
    fmt = _axis_formatter(unit)
    if fmt:
        ax.yaxis.set_major_formatter(fmt)
    ax.tick_params(labelsize=7)
    ax.set_xlabel("seconds before " + datetime.fromtimestamp(end).strftime("%H:%M:%S"), fontsize=7)
    ax.grid(alpha=0.25)
    ncol = 1 if len(series) <= 4 else 3 if len(series) <= 9 else 4
    ax.legend(fontsize=6, ncol=ncol, loc="upper left", frameon=False)


def _with_gaps(pts: list[tuple[float, float]], end: float) -> tuple[list[float], list[float]]:
    """x (seconds before `end`) and y, with a NaN where samples are missing, so the line breaks there as
    Grafana's does (spanNulls off) instead of bridging the gap."""
    steps = [b[0] - a[0] for a, b in zip(pts, pts[1:])]
    step = min(steps) if steps else 0
    x, y = [], []
    for k, (t, v) in enumerate(pts):
        if k and t - pts[k - 1][0] > 1.5 * step:
            x.append(t - end - step)
            y.append(math.nan)
        x.append(t - end)
        y.append(v)
    return x, y


def draw_stat(ax, panel: dict, series) -> None:
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    last = [pts[-1][1] for _, _, pts in series if pts and math.isfinite(pts[-1][1])]
    if not last:
        finite = [v for _, _, pts in series for _, v in pts if math.isfinite(v)]
        last = finite[-1:]
    if not last:
        return _no_data(ax)
    ax.text(0.5, 0.45, fmt_value(last[0], defaults.get("unit"), defaults.get("decimals")), ha="center",
            va="center", fontsize=18, fontweight="bold", color="#3d71d9", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def draw_table(ax, panel: dict, series) -> None:
    """A table; the groupingToMatrix transformation (rows x columns of one value) is applied."""
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    rows = [(labels, pts[-1][1]) for _, labels, pts in series if pts]
    ax.set_xticks([])
    ax.set_yticks([])
    if not rows:
        return _no_data(ax)
    matrix = next((t["options"] for t in panel.get("transformations", []) if t["id"] == "groupingToMatrix"), None)
    if matrix:
        rf, cf = matrix["rowField"], matrix["columnField"]
        rk = sorted({lab.get(rf, "") for lab, _ in rows}, key=_natural_key)
        ck = sorted({lab.get(cf, "") for lab, _ in rows}, key=_natural_key)
        cell = {(lab.get(rf, ""), lab.get(cf, "")): v for lab, v in rows}
        text = [[r] + [fmt_value(cell[r, c], defaults.get("unit"), defaults.get("decimals")) if (r, c) in cell
                       else "" for c in ck] for r in rk]
        col_labels = [f"{rf} \\ {cf}"] + ck
    else:
        keys = sorted({k for lab, _ in rows for k in lab if k != "__name__"})
        text = [[lab.get(k, "") for k in keys] + [fmt_value(v, defaults.get("unit"))] for lab, v in rows]
        col_labels = keys + ["value"]
    table = ax.table(cellText=text, colLabels=col_labels, cellLoc="center", bbox=[0, 0, 1, 1])
    table.auto_set_font_size(False)
    table.set_fontsize(max(3.5, min(7.0, 110 / (len(text) + 1))))
    for cell in table.get_celld().values():
        cell.set_linewidth(0.3)
    ax.axis("off")


def draw_heatmap(ax, panel: dict, series, start: float, end: float) -> None:
    """A Prometheus histogram (format heatmap): cumulative `le` buckets turned into per-bucket counts."""
    import numpy as np

    buckets = {}
    for _, labels, pts in series:
        le = labels.get("le")
        if le is not None:
            buckets[float(le)] = dict(pts)
    times = sorted({t for d in buckets.values() for t in d})
    if not buckets or not times:
        return _no_data(ax)
    les = sorted(buckets)
    cum = np.array([[buckets[le].get(t, np.nan) for t in times] for le in les])
    counts = np.diff(np.vstack([np.zeros(len(times)), np.nan_to_num(cum)]), axis=0).clip(min=0)
    if counts.sum() <= 0:
        return _no_data(ax)
    labels = [("+Inf" if math.isinf(le) else f"≤{le:g}") for le in les]
    x = [t - end for t in times]
    ax.imshow(counts, aspect="auto", origin="lower", cmap="Oranges", interpolation="nearest",
              extent=(x[0], x[-1] if len(x) > 1 else x[0] + 1, -0.5, len(les) - 0.5))
    ax.set_yticks(range(len(les)))
    ax.set_yticklabels(labels, fontsize=6)
    ax.tick_params(labelsize=7)
    ax.set_xlim(start - end, 0)
    ax.set_xlabel("seconds before " + datetime.fromtimestamp(end).strftime("%H:%M:%S"), fontsize=7)


def _natural_key(s: str):
    import re

    return [(0, float(p), "") if p.replace(".", "", 1).isdigit() else (1, 0.0, p)
            for p in re.split(r"(\d+(?:\.\d+)?)", s) if p]


def render_dashboard(dashboard: dict, client: promstack.PromClient, out: Path, start: float, end: float,
                     step: float | None = None, rate_interval: str = "1m", chosen: dict | None = None,
                     dpi: int = 64) -> dict[str, bool]:
    """Draw every panel into `out` (PNG); returns {panel title: has data}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    step = step or max(1.0, (end - start) / 240)
    variables = promstack.resolve_variables(dashboard, client, chosen)
    panels = promstack.panels(dashboard)
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    unit_w, unit_h, header = 0.75, 0.36, 0.8  # inches: grid column, grid row, title band
    fig_w, fig_h = GRID_COLUMNS * unit_w, rows * unit_h + header
    fig = plt.figure(figsize=(fig_w, fig_h))
    var_text = "   ".join(f"{k}: {', '.join(v) or '-'}" for k, v in variables.items())
    fig.text(0.005, 1 - 0.35 * header / fig_h, dashboard["title"], fontsize=14, fontweight="bold", va="center")
    fig.text(0.995, 1 - 0.35 * header / fig_h, var_text, fontsize=8, ha="right", va="center", color="#555555")
    has_data = {}
    for p in panels:
        g = p["gridPos"]
        # panel box in inches (origin bottom left), then margins: title on top; ticks and labels for plots
        x0, w = g["x"] * unit_w, g["w"] * unit_w
        y1 = fig_h - header - g["y"] * unit_h
        h = g["h"] * unit_h
        if p["type"] in ("timeseries", "heatmap"):
            left, right, bottom, top = 0.7, 0.15, 0.45, 0.3
        else:
            left, right, bottom, top = 0.1, 0.1, 0.1, 0.3
        rect = [(x0 + left) / fig_w, (y1 - h + bottom) / fig_h, (w - left - right) / fig_w,
                (h - top - bottom) / fig_h]
        ax = fig.add_axes(rect)
        ax.set_title(p["title"], fontsize=9, loc="left")
        series = fetch_panel(p, client, variables, start, end, step, rate_interval)
        has_data[p["title"]] = any(math.isfinite(v) for _, _, pts in series for _, v in pts)
        if p["type"] == "stat":
            draw_stat(ax, p, series)
        elif p["type"] == "table":
            draw_table(ax, p, series)
        elif p["type"] == "heatmap":
            draw_heatmap(ax, p, series, start, end)
        else:
            draw_timeseries(ax, p, series, start, end)
    out.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi)
    plt.close(fig)
    # a 128-colour palette: a third of the bytes, and charts look the same
    from PIL import Image

    buf.seek(0)
    Image.open(buf).convert("RGB").quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(out, optimize=True)
    return has_data


def render_all(client: promstack.PromClient, out_dir: Path, start: float, end: float, rate_interval: str = "1m",
               step: float | None = None, chosen: dict | None = None, dpi: int = 64,
               names: list[str] | None = None) -> dict[str, dict[str, bool]]:
    report = {}
    for name, dash in promstack.load_dashboards().items():
        if names and name not in names:
            continue
        path = out_dir / f"dashboard-{name}.png"
        report[name] = render_dashboard(dash, client, path, start, end, step, rate_interval, chosen, dpi)
        empty = [t for t, ok in report[name].items() if not ok]
        print(f"render: {path} ({len(report[name]) - len(empty)}/{len(report[name])} panels with data"
              + (f"; empty: {', '.join(empty)}" if empty else "") + ")")
    return report


# ------------------------------------------------------------------------------------------------ demo
def demo(out_dir: Path, config_path: Path, load_seconds: float, phases: list[int], dpi: int,
         replicas: int = 2) -> int:
    """Serve `config_path` on CPU as the compose stack does (a fleet of `replicas` behind the router), scrape it
    with a local Prometheus, run a chat load in phases of rising concurrency (so the adaptive block size has load
    changes to follow) and render."""
    import yaml

    from harness.server import ManagedFleet

    config = yaml.safe_load(config_path.read_text())
    base = config_path.resolve().parent
    for section, key in (("model", "path"), ("model", "tokenizer"), ("speculative", "draft_model_path")):
        value = config.get(section, {}).get(key)
        if value and not Path(value).is_absolute():
            config[section][key] = str((base / value).resolve())
    with tempfile.TemporaryDirectory(prefix="dflash-render-") as tmp, \
            ManagedFleet(config, Path(tmp), "fleet", replicas=replicas) as fleet:
        with promstack.LocalPrometheus([], Path(tmp) / "prometheus", targets_file=fleet.targets_file,
                                       router_targets=[f"127.0.0.1:{fleet.metrics_port}"]) as prom:
            prom.wait_for_scrapes(f'count(up{{job="{promstack.SCRAPE_JOB}"}} == 1) == {replicas}')
            model = config["model"].get("served_name") or config["model"]["path"]
            start = time.time()
            for users in phases:
                print(f"render: {load_seconds / len(phases):.0f} s of chat load on {fleet.url}, {users} users")
                load = promstack.chat_load(fleet.url, model, load_seconds / len(phases), users)
                print(f"render: {load.requests} requests, {len(load.failures)} failures")
            time.sleep(3)
            render_all(prom.client, out_dir, start - 5, time.time(), rate_interval="10s", step=1, dpi=dpi)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prometheus", help="Prometheus URL, e.g. http://127.0.0.1:9090")
    p.add_argument("--since", default="15m", help="time range ending now: 90s, 15m, 2h (default 15m)")
    p.add_argument("--rate-interval", default="1m", help="what $__rate_interval stands for (default 1m)")
    p.add_argument("--var", action="append", default=[], metavar="NAME=VALUE",
                   help="select a template variable's value (repeatable; default: all values)")
    p.add_argument("--dashboard", action="append", help="render only these (serving, dflash, fleet)")
    p.add_argument("--out", type=Path, default=Path("."), help="output directory (dashboard-<name>.png)")
    p.add_argument("--dpi", type=int, default=64)
    p.add_argument("--demo", action="store_true",
                   help="start a CPU fleet (router + 2 replicas) and a local Prometheus, load, render")
    p.add_argument("--config", type=Path, default=REPO / "deploy/configs/cpu-docker.yaml", help="--demo's config")
    p.add_argument("--load-seconds", type=float, default=60)
    p.add_argument("--phases", default="1,4,8", help="--demo's concurrent users per load phase (default 1,4,8)")
    a = p.parse_args(argv)
    if a.demo:
        return demo(a.out, a.config, a.load_seconds, [int(u) for u in a.phases.split(",")], a.dpi)
    if not a.prometheus:
        p.error("--prometheus URL or --demo is required")
    seconds = float(a.since[:-1]) * {"s": 1, "m": 60, "h": 3600}[a.since[-1]] if a.since[-1] in "smh" \
        else float(a.since)
    chosen: dict[str, list[str]] = {}
    for v in a.var:
        name, _, value = v.partition("=")
        chosen.setdefault(name, []).append(value)
    end = time.time()
    try:
        render_all(promstack.PromClient(a.prometheus), a.out, end - seconds, end, a.rate_interval, None,
                   chosen or None, a.dpi, a.dashboard)
    except promstack.PrometheusError as e:
        print(f"render: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
