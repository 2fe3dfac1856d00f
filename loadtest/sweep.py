"""Sweep server configurations x workloads x concurrency with Locust; write results.json/.csv, report.md, plots.

    python -m loadtest.sweep                                          # every config and workload in configs.yaml
    python -m loadtest.sweep --configs no-spec dflash-b16 --workloads prose --users 1 4 16 --duration 20
    python -m loadtest.sweep --url mine=http://127.0.0.1:30000 --users 1 2 --duration 5
    python -m loadtest.sweep --dataset my.jsonl --temperature 0.7       # one ad-hoc workload, named `custom`
    python -m loadtest.sweep --report-only --out benchmarks/results/sweep-cpu
    python -m loadtest.sweep --interleave --duration 15                # every server up at once, points in turns
    python -m loadtest.sweep --rates 1 3 --slo-ttft 2000 --slo-tpot 100  # open loop: Poisson arrivals at 1, 3 req/s

Per configuration: start `dflash-serve serve` (harness.server.ManagedServer) -- or, for a configuration with a
`fleet:` section, `dflash-serve fleet` (harness.server.ManagedFleet: the router in front, the replicas' metrics
summed) -- unless `--url NAME=URL` gives a running server; then per workload (prompts + temperature, `workloads:` in the configurations file) and user
count: warm-up requests, scrape /metrics, run `locust -f loadtest/chat.py --headless` as a subprocess (Locust's
gevent patching breaks SGLang, so never in this process), wait until the server is idle, scrape again. Each
workload's results go to OUT/<workload>/ and are rewritten after every point, so an interrupted sweep keeps its
data. With --interleave every configuration's server starts first and each (workload, users) point is measured
for every configuration in turn, the order reversed on every other point: ratios between configurations are then
taken seconds apart, not a configuration's block of points apart (a shared machine's speed drifts over minutes).
With --rates the points are request rates instead of user counts: an open loop (chat.py --rate), Poisson or
constant arrivals, at most --max-in-flight requests in flight, --warmup-s seconds of arrivals unmeasured, and
goodput against --slo-ttft / --slo-tpot. Behind a router (--url to a fleet) the server-side numbers come from
each replica's /metrics: --replicas NAME=URL,URL, else the router's /workers list (its admin key in
$LOCUST_ADMIN_KEY).
"""
from __future__ import annotations

import argparse
import copy
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import yaml

from loadtest import report, server_metrics
from loadtest.dataset import DatasetError, Request, load_requests

REPO = Path(__file__).resolve().parents[1]
CHAT = Path(__file__).resolve().parent / "chat.py"
DEFAULT_CONFIGS = Path(__file__).resolve().parent / "configs.yaml"
DEFAULT_OUT = REPO / "benchmarks" / "results" / "sweep-cpu"
DEFAULT_USERS = (1, 2, 4, 8, 16, 32, 50)


class SweepError(Exception):
    """A problem with the sweep's inputs or a server; the message says what to fix."""


def log(msg: str) -> None:
    print(f"[sweep] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------- configurations

def deep_merge(base: dict, override: dict) -> dict:
    """`override` into a copy of `base`; nested mappings merge, a None value deletes the key."""
    out = copy.deepcopy(base)
    for k, v in override.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


class Workload(NamedTuple):
    """What the users send and how they read it: prompts, a sampling temperature, and the client's own work."""

    dataset: Path | None          # JSONL requests (chat or completion lines); None = the bundled code mix
    temperature: float            # for the lines without their own `temperature`
    client_tokenizer: Path | None = None  # chat.py --client-tokenizer: re-tokenize every chunk in the client


WORKLOAD_FIELDS = {"dataset": "FILE (relative to the configurations file)", "temperature": "T >= 0 (default 0)",
                   "client_tokenizer": "DIR of a Hugging Face tokenizer (default: none)"}


CUSTOM = "custom"  # the workload --dataset / --temperature describe


class Configs(NamedTuple):
    baseline: str | None          # speedups are relative to this configuration
    base: Path                    # the dflash-serve config every override applies to
    full: dict[str, dict]         # name -> complete config, absolute paths, validated
    overrides: dict[str, dict]    # name -> the override as written
    workloads: dict[str, Workload]  # name -> workload (the file's `workloads:`; the bundled mix, greedy, if none)


def load_workloads(path: Path, doc: dict) -> dict[str, Workload]:
    raw = doc.get("workloads")
    if raw is None:
        return {"code": Workload(None, 0.0)}
    fields = ", ".join(f"{k}: {v}" for k, v in WORKLOAD_FIELDS.items())
    if not isinstance(raw, dict) or not raw:
        raise SweepError(f"{path}: `workloads:` must map names to {{{fields}}}")
    out = {}
    for name, w in raw.items():
        if not isinstance(w, dict):
            raise SweepError(f"{path}: workloads.{name}: expected a mapping {{{fields}}}, got {w!r}")
        unknown = sorted(set(w) - set(WORKLOAD_FIELDS))
        if unknown:
            raise SweepError(f"{path}: workloads.{name}.{unknown[0]}: unknown field; a workload has "
                             f"{{{fields}}}")
        t = w.get("temperature", 0.0)
        if not isinstance(t, (int, float)) or isinstance(t, bool) or t < 0:
            raise SweepError(f"{path}: workloads.{name}.temperature: expected a number >= 0, got {t!r}")
        dataset = (path.parent / w["dataset"]).resolve() if w.get("dataset") else None
        if dataset is not None:
            try:
                load_requests(dataset)
            except DatasetError as e:
                raise SweepError(f"{path}: workloads.{name}.dataset: {e}") from None
        tokenizer = w.get("client_tokenizer")
        if tokenizer is not None:
            if not isinstance(tokenizer, str) or not tokenizer:
                raise SweepError(f"{path}: workloads.{name}.client_tokenizer: expected a directory path, "
                                 f"got {tokenizer!r}")
            tokenizer = (path.parent / tokenizer).resolve()
            if not any((tokenizer / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
                raise SweepError(f"{path}: workloads.{name}.client_tokenizer: {tokenizer} holds no Hugging Face "
                                 f"tokenizer (tokenizer.json or tokenizer_config.json); e.g. "
                                 f"../models/tiny-code/target")
        out[name] = Workload(dataset, float(t), tokenizer)
    return out


def describe_workload(w: Workload) -> dict:
    """What the report says a workload sends: endpoints, the temperatures lines carry, the client's work."""
    reqs = load_requests(w.dataset)
    return {"temperature": w.temperature, "dataset": str(w.dataset or "bundled mix"),
            "endpoints": sorted({r.endpoint for r in reqs}),
            "line_temperatures": sorted({r.temperature for r in reqs if r.temperature is not None}),
            "client_tokenizer": str(w.client_tokenizer) if w.client_tokenizer else None}


def load_configs(path: Path, base_override: Path | None = None) -> Configs:
    """The named configurations of `path`, each validated now.

    Validation here, not at server start, so a typo in the 4th configuration fails in a second rather than
    after three servers' worth of sweep.
    """
    from service.config import ConfigError, parse_config

    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise SweepError(f"{path}: cannot read the configurations ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("configs"), dict) or not doc["configs"]:
        raise SweepError(f"{path}: expected `configs:` mapping names to config overrides (see loadtest/configs.yaml)")
    base_path = base_override or (path.parent / doc.get("base", "../deploy/configs/cpu.yaml"))
    try:
        base = yaml.safe_load(base_path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise SweepError(f"{path}: base config {base_path}: {e}") from None
    configs = {}
    for name, override in doc["configs"].items():
        if not isinstance(override, dict):
            raise SweepError(f"{path}: configs.{name}: expected a mapping of overrides, got {override!r}")
        try:
            cfg = parse_config(deep_merge(base, override), base=base_path.resolve().parent)
        except ConfigError as e:
            raise SweepError(f"{path}: configs.{name}: {e}") from None
        configs[name] = cfg.model_dump(mode="json", exclude_none=True)
    return Configs(doc.get("baseline"), base_path.resolve(), configs, doc["configs"], load_workloads(path, doc))


def parse_urls(items: list[str]) -> dict[str, str]:
    urls = {}
    for item in items:
        name, sep, url = item.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise SweepError(f"--url {item!r}: expected NAME=http://HOST:PORT")
        urls[name] = url.rstrip("/")
    return urls


# ---------------------------------------------------------------------------------------------- one point

def _headers() -> dict[str, str]:
    key = os.environ.get("LOCUST_API_KEY")        # the same variable chat.py's --api-key reads
    return {"Authorization": f"Bearer {key}"} if key else {}


ADMIN_KEY_ENV = "LOCUST_ADMIN_KEY"  # a router's control-plane key: its /workers lists the replicas


def router_workers(url: str, timeout: float = 10) -> list[str]:
    """The replica URLs a router in front of `url` lists (SGLang's router: GET /workers, with the admin key of
    $LOCUST_ADMIN_KEY, else the API key); [] when `url` is no router or refuses."""
    import urllib.request

    key = os.environ.get(ADMIN_KEY_ENV)
    headers = {"Authorization": f"Bearer {key}"} if key else _headers()
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{url}/workers", headers=headers), timeout=timeout) as r:
            workers = json.load(r).get("workers", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [w["url"].rstrip("/") for w in workers if isinstance(w, dict) and isinstance(w.get("url"), str)]


def metrics_sources(name: str, url: str, replicas: dict[str, list[str]]) -> list[str]:
    """Where configuration `name`'s server-side numbers come from: `url` itself when it serves SGLang's metrics;
    else (a router) its replicas, from --replicas or the router's /workers. A router's own /metrics know no
    acceptance or widths, so a fleet behind one is read replica by replica and summed."""
    if name in replicas:
        return replicas[name]
    own = server_metrics.scrape(url, _headers(), timeout=10)
    if own is not None and server_metrics.total(own, "sglang:num_running_reqs") is not None:
        return [url]
    found = [u for u in router_workers(url) if server_metrics.scrape(u, _headers(), timeout=10) is not None]
    if found:
        log(f"{name}: {url} is a router; reading the /metrics of its replicas {', '.join(found)}")
        return found
    log(f"{name}: WARNING: {url} serves no SGLang metrics and lists no reachable replica (a router: give "
        f"--replicas {name}=URL,URL or its admin key in ${ADMIN_KEY_ENV}); no server-side numbers")
    return [url]


def parse_replicas(items: list[str]) -> dict[str, list[str]]:
    out = {}
    for item in items:
        name, sep, urls = item.partition("=")
        listed = [u.rstrip("/") for u in urls.split(",") if u]
        if not sep or not name or not listed or not all(u.startswith(("http://", "https://")) for u in listed):
            raise SweepError(f"--replicas {item!r}: expected NAME=http://HOST:PORT[,http://HOST:PORT...]")
        out[name] = listed
    return out


def _post(url: str, body: dict, timeout: float) -> dict:
    import urllib.request

    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json", **_headers()})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def model_name(url: str) -> str:
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(f"{url}/v1/models", headers=_headers()), timeout=30) as r:
            return json.load(r)["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise SweepError(f"{url}/v1/models: no model listed ({e}); is this an OpenAI-compatible server?") from None


def warm_up(url: str, n: int, request: Request, timeout: float = 600) -> None:
    """`n` short requests: first-request costs (allocations, caches) stay out of the measurement."""
    model = model_name(url) if n else ""
    for _ in range(n):
        try:
            r = _post(f"{url}{request.endpoint}",
                      {"model": model, **request.payload(), "max_tokens": 16, "temperature": 0}, timeout)
        except OSError as e:
            raise SweepError(f"warm-up request to {url} failed: {e}; is the server up?") from None
        if not r.get("choices"):
            raise SweepError(f"warm-up request to {url} returned no choices: {str(r)[:200]}")


def wait_idle(metrics_urls: list[str], timeout: float = 300) -> bool:
    """Wait until the server runs and queues nothing: Locust abandons in-flight requests at the end of a point,
    and the server finishes them, which would slow the next point down."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server_metrics.is_idle(server_metrics.scrape_all(metrics_urls, _headers())):
            return True
        time.sleep(1)
    return False


def open_loop_counts(rate: float, args: argparse.Namespace) -> tuple[int, int]:
    """(measured requests, warm-up arrivals) of an open-loop point at `rate`: --requests, else --duration
    seconds' worth; --warmup-s seconds' worth of arrivals before them."""
    measured = args.requests if args.requests is not None else max(1, round(rate * args.duration))
    return measured, round(rate * args.warmup_s)


def run_point(url: str, users: int | None, args: argparse.Namespace, raw_dir: Path, workload: Workload,
              metrics_urls: list[str] | None = None, rate: float | None = None) -> dict:
    """Warm up, run Locust headless at `users` (closed loop) or at `rate` requests/s (open loop, at most
    --max-in-flight in flight), and return the point's record. `metrics_urls`: where the server's /metrics are
    (a fleet's replicas; default `url`)."""
    metrics_urls = metrics_urls or [url]
    raw_dir.mkdir(parents=True, exist_ok=True)
    stem = raw_dir / (f"r{rate:g}" if rate else f"u{users}")
    summary_path = Path(f"{stem}_summary.json")
    summary_path.unlink(missing_ok=True)
    warm_up(url, args.warmup, load_requests(workload.dataset)[0])
    before = server_metrics.scrape_all(metrics_urls, _headers())
    slots = args.max_in_flight if rate else users
    cmd = [sys.executable, "-m", "locust", "-f", str(CHAT), "--headless", "--only-summary",
           "-u", str(slots), "-r", str(slots), "--host", url, "--csv", str(stem),
           "--summary-file", str(summary_path), "--max-tokens", str(args.max_tokens),
           "--temperature", str(workload.temperature), "--max-failure-ratio", str(args.max_failure_ratio),
           "--prompt-order", "sequence"]  # every configuration: the same prompts in the same order
    if args.slo_ttft:
        cmd += ["--slo-ttft", str(args.slo_ttft)]
    if args.slo_tpot:
        cmd += ["--slo-tpot", str(args.slo_tpot)]
    if rate:
        # the same arrival times and prompts for every configuration; every measured request runs to its end
        measured, warm = open_loop_counts(rate, args)
        cmd += ["--rate", str(rate), "--arrival", args.arrival, "--requests", str(measured),
                "--warmup-requests", str(warm)]
    else:
        cmd += ["-t", f"{args.duration}s"] if args.requests is None else ["--requests", str(args.requests)]
    if workload.dataset:
        cmd += ["--dataset", str(workload.dataset)]
    if workload.client_tokenizer:
        cmd += ["--client-tokenizer", str(workload.client_tokenizer)]
    if args.ignore_eos:
        cmd += ["--ignore-eos"]
    cmd += args.locust_arg
    # the CPU layer's startup hook has no business in the load generator
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_SERVE_CPU"}
    if rate:   # the arrivals take warm-up + duration; an overloaded server then drains what queued
        limit = args.point_timeout if args.requests is not None else int(args.warmup_s + args.duration) + 900
    else:
        limit = (args.duration + 300) if args.requests is None else args.point_timeout
    started = time.monotonic()
    with open(f"{stem}_locust.log", "w") as logf:
        try:
            rc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=limit).returncode
        except subprocess.TimeoutExpired:
            rc = None
    wall = time.monotonic() - started
    idle = wait_idle(metrics_urls)
    after = server_metrics.scrape_all(metrics_urls, _headers())
    point = {"users": None if rate else users, "rate": rate, "locust_exit_code": rc, "wall_s": wall, "idle_after": idle,
             "files": {"csv_prefix": str(stem), "summary": str(summary_path), "log": f"{stem}_locust.log"}}
    if summary_path.is_file():
        summary = json.loads(summary_path.read_text())
        point |= {k: summary[k] for k in ("requests", "failures", "failure_ratio", "completed", "output_tokens_total",
                                          "output_tok_s", "req_s", "window", "window_s", "duration_s", "model")}
        point |= {k: summary.get(k) for k in ("slo_met", "slo_met_share", "goodput_req_s", "user_tok_s",
                                              "dispatch_delay_ms")}
        if rate:
            point |= {"max_in_flight": args.max_in_flight, "arrival": args.arrival}
        point |= summary["metrics"]
    point["server"] = server_metrics.point_deltas(before, after)
    point["ok"] = rc == 0 and summary_path.is_file()
    if not point["ok"]:
        point["error"] = _why(rc, point, stem)
    return point


def _why(rc: int | None, point: dict, stem: Path) -> str:
    """One line on why a point failed: the failure ratio and the most frequent failure, else the log's end."""
    head = f"Locust timed out after {point['wall_s']:.0f}s" if rc is None else f"Locust exited {rc}"
    try:
        with open(f"{stem}_failures.csv") as f:
            top = max(csv.DictReader(f), key=lambda r: int(r["Occurrences"]), default=None)
    except OSError:
        top = None
    if point.get("requests") and top:
        return (f"{head}: {point['failures']} of {point['requests']} requests failed, most often "
                f"({top['Occurrences']}x) {top['Method']} {top['Name']}: {top['Error'][:300]}")
    tail = Path(f"{stem}_locust.log").read_text(errors="replace").splitlines()[-5:]
    return f"{head}: " + " | ".join(tail)[-500:]


# ---------------------------------------------------------------------------------------------- the sweep

def _fmt_point(p: dict) -> str:
    if not p.get("ok"):
        return f"FAILED ({p.get('error', '?')[:200]})"
    acc = p["server"].get("accept_length")
    good = p.get("goodput_req_s")
    return (f"{p['output_tok_s']:.1f} tok/s, {p['req_s']:.2f} req/s"
            + (f" (goodput {good:.2f})" if good is not None else "")
            + f", TTFT p50 {p['ttft'].get('p50', float('nan')):.0f} ms, "
            f"ITL p50 {p['itl'].get('p50', float('nan')):.1f} ms, {p['completed']} done, {p['failures']} failed"
            + (f", accept {acc:.2f}" if acc else ""))


def chosen_workloads(args: argparse.Namespace, workloads: dict[str, Workload]) -> dict[str, Workload]:
    """--dataset/--temperature: one ad-hoc workload (`custom`); else --workloads (default: all of the file's)."""
    if args.dataset is not None or args.temperature is not None:
        if args.workloads:
            raise SweepError("--workloads and --dataset/--temperature exclude each other: a workload is its own "
                             "prompts and temperature")
        return {CUSTOM: Workload(args.dataset, args.temperature if args.temperature is not None else 0.0)}
    names = args.workloads or list(workloads)
    unknown = [n for n in names if n not in workloads]
    if unknown:
        raise SweepError(f"unknown workload(s) {unknown}: choose from {list(workloads)} in {args.config_file}")
    return {n: workloads[n] for n in names}


def _open(name: str, head: str, urls: dict[str, str], configs: dict[str, dict], overrides: dict[str, dict],
          out: Path, servers: list, replicas: dict[str, list[str]] | None = None) -> tuple[str, list[str] | None]:
    """(url, metrics urls) of configuration `name`: the --url given (behind a router: its replicas' metrics), or
    a server (or fleet) started now and appended to `servers` (the caller stops them)."""
    if name in urls:
        log(f"{head}: using {urls[name]}")
        return urls[name], metrics_sources(name, urls[name], replicas or {})
    from harness.server import ManagedFleet, ManagedServer

    if "fleet" in overrides[name]:
        n = configs[name]["fleet"]["replicas"]
        server = ManagedFleet(configs[name], out / "servers", name, replicas=n)
        log(f"{head}: starting a fleet of {n} (log {server.log_path})")
    else:
        server = ManagedServer(configs[name], out / "servers", name)
        log(f"{head}: starting server (log {server.log_path})")
    servers.append(server)
    t0 = time.monotonic()
    server.start()
    log(f"{head}: ready at {server.url} in {time.monotonic() - t0:.0f}s")
    return server.url, getattr(server, "replica_urls", None)


def sweep(args: argparse.Namespace) -> int:
    baseline, base, configs, overrides, file_workloads = load_configs(args.config_file, args.base_config)
    workloads = chosen_workloads(args, file_workloads)
    urls = parse_urls(args.url)
    replicas = parse_replicas(args.replicas)
    names = args.configs or (list(urls) if urls else list(configs))
    unknown = [n for n in names if n not in configs and n not in urls]
    if unknown:
        raise SweepError(f"unknown configuration(s) {unknown}: choose from {list(configs)} in {args.config_file} "
                         f"or give --url NAME=URL")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    loads = args.rates or args.users   # the points: request rates (open loop) or user counts (closed loop)
    metas = {wl: {"started": started, "workload": wl, "users": None if args.rates else args.users,
                  "rates": args.rates, "arrival": args.arrival if args.rates else None,
                  "max_in_flight": args.max_in_flight if args.rates else None, "warmup_s": args.warmup_s,
                  "slo_ttft_ms": args.slo_ttft or None, "slo_tpot_ms": args.slo_tpot or None,
                  "duration_s": args.duration if args.requests is None else None,
                  "requests": args.requests, "max_tokens": args.max_tokens, **describe_workload(w),
                  "ignore_eos": args.ignore_eos, "warmup": args.warmup, "interleave": args.interleave,
                  "baseline": args.baseline or baseline,
                  "cpu_count": os.cpu_count(), "base_config": str(base),
                  "configs": {n: ({"url": urls[n]} if n in urls else {"override": overrides[n], "config": configs[n]})
                              for n in names}}
             for wl, w in workloads.items()}
    points: dict[str, list[dict]] = {wl: [] for wl in workloads}
    total_points = len(names) * len(workloads) * len(loads)
    progress = {"done": 0, "failed": 0}

    def measure(name: str, url: str, metrics_urls: list[str] | None, wl: str, load: float, head: str) -> None:
        what = f"rate {load:g} req/s" if args.rates else f"users {load}"
        where = f"{head}, {wl}, {what} ({loads.index(load) + 1}/{len(loads)})"
        log(f"{where} ...")
        users, rate = (None, load) if args.rates else (load, None)
        point = {"config": name, "workload": wl,
                 **run_point(url, users, args, out / wl / "raw" / name, workloads[wl], metrics_urls, rate)}
        if metrics_urls and metrics_urls != [url]:
            point["metrics_from"] = metrics_urls
        points[wl].append(point)
        progress["done"] += 1
        progress["failed"] += not point["ok"]
        report.write_results(out / wl, metas[wl], points[wl])
        log(f"{where}: {_fmt_point(point)} [{progress['done']}/{total_points}]")

    def broken(name: str, head: str, e: Exception) -> None:
        # one broken configuration (a server that will not start) must not cost the others their results
        log(f"{head}: FAILED: {e}")
        progress["failed"] += 1
        for wl in workloads:
            points[wl].append({"config": name, "workload": wl, "users": None, "ok": False, "error": str(e)[:2000]})
            report.write_results(out / wl, metas[wl], points[wl])

    heads = {name: f"config {ci}/{len(names)} {name}" for ci, name in enumerate(names, 1)}
    if args.interleave:
        servers: list = []
        try:
            live = {}
            for name in names:
                try:
                    live[name] = _open(name, heads[name], urls, configs, overrides, out, servers, replicas)
                except (SweepError, RuntimeError) as e:
                    broken(name, heads[name], e)
            for wl in workloads:
                for ui, load in enumerate(loads):
                    # every configuration in turn at this point, the order reversed on every other point: the
                    # machine's drift over minutes falls on all of them alike
                    order = list(live) if ui % 2 == 0 else list(live)[::-1]
                    for name in order:
                        measure(name, *live[name], wl, load, heads[name])
        finally:
            for server in servers:
                server.stop()
    else:
        for name in names:
            servers = []
            try:
                url, metrics_urls = _open(name, heads[name], urls, configs, overrides, out, servers, replicas)
                for wl in workloads:
                    for load in loads:
                        measure(name, url, metrics_urls, wl, load, heads[name])
            except (SweepError, RuntimeError) as e:
                broken(name, heads[name], e)
            finally:
                for server in servers:
                    server.stop()
    for wl in workloads:
        metas[wl]["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
        report.write_results(out / wl, metas[wl], points[wl])
        written = report.write_report(out / wl)
        log(f"{wl}: wrote {', '.join(str(p.relative_to(out)) for p in written)} in {out}")
    if progress["failed"]:
        log(f"{progress['failed']} point(s) failed; see report.md and the raw/ logs")
    return 1 if progress["failed"] else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.sweep", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config-file", type=Path, default=DEFAULT_CONFIGS, help="named server configurations")
    p.add_argument("--base-config", type=Path, default=None, help="override the file's `base:` config")
    p.add_argument("--configs", nargs="+", metavar="NAME", help="run only these (default: all, or the --url names)")
    p.add_argument("--url", action="append", default=[], metavar="NAME=URL",
                   help="use a running server for NAME instead of starting one (repeatable)")
    p.add_argument("--baseline", help="configuration speedups are relative to (default: the file's `baseline:`)")
    p.add_argument("--replicas", action="append", default=[], metavar="NAME=URL,URL",
                   help="NAME's --url is a router: read the server-side numbers from these replicas' /metrics "
                        "(default: the replicas the router's /workers lists, with the admin key in "
                        f"${ADMIN_KEY_ENV}) (repeatable)")
    p.add_argument("--users", type=int, nargs="+", default=list(DEFAULT_USERS), help="concurrent users per point")
    p.add_argument("--rates", type=float, nargs="+", default=None, metavar="REQ_S",
                   help="open loop instead of --users: one point per request rate (requests/s)")
    p.add_argument("--arrival", choices=("poisson", "constant"), default="poisson",
                   help="open loop: arrival process (seeded: every configuration gets the same arrival times)")
    p.add_argument("--max-in-flight", type=int, default=64,
                   help="open loop: at most this many requests in flight (an arrival beyond waits for one)")
    p.add_argument("--warmup-s", type=float, default=5.0,
                   help="open loop: seconds of arrivals sent before the measured ones, not measured")
    p.add_argument("--slo-ttft", type=float, default=None, metavar="MS",
                   help="goodput: a request meets its SLO with TTFT <= MS (default: no TTFT limit)")
    p.add_argument("--slo-tpot", type=float, default=None, metavar="MS",
                   help="goodput: ... and TPOT <= MS (default: no TPOT limit)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--duration", type=int, default=60, help="seconds of load per point")
    mode.add_argument("--requests", type=int, default=None,
                      help="requests per point instead of --duration (exact sample sizes; throughput then includes "
                           "the tail where users run out of requests)")
    p.add_argument("--point-timeout", type=int, default=3600, help="seconds before a --requests point is killed")
    p.add_argument("--warmup", type=int, default=2, help="warm-up requests before each point")
    p.add_argument("--interleave", action="store_true",
                   help="start every configuration's server at once and measure each point for all of them in "
                        "turn (side by side: a shared machine's speed drifts over minutes) instead of one "
                        "configuration's points after another's; needs memory for every server at once")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--workloads", nargs="+", metavar="NAME",
                   help="run only these workloads of the configurations file (default: all)")
    p.add_argument("--temperature", type=float, default=None,
                   help="with or without --dataset: one ad-hoc workload `custom` instead of the file's")
    p.add_argument("--ignore-eos", action="store_true", help="every request generates exactly --max-tokens")
    p.add_argument("--dataset", type=Path, default=None,
                   help="JSONL prompts of an ad-hoc workload `custom` (temperature --temperature, default 0)")
    p.add_argument("--max-failure-ratio", type=float, default=0.01, help="a point fails above this")
    p.add_argument("--locust-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every Locust run, e.g. --locust-arg=--think-time=1 (repeatable)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    p.add_argument("--report-only", action="store_true", help="rewrite report.md, results.csv and plots from "
                                                               "the results.json of --out (or of each workload "
                                                               "directory in it) without running anything")
    args = p.parse_args(argv)
    try:
        if args.report_only:
            dirs = [args.out] if (args.out / report.RESULTS).is_file() else \
                sorted(d for d in args.out.glob("*") if (d / report.RESULTS).is_file())
            if not dirs:
                raise SweepError(f"no {report.RESULTS} in {args.out} or its workload directories: run the sweep "
                                 f"first (python -m loadtest.sweep --out {args.out})")
            for d in dirs:
                written = report.write_report(d)
                log(f"wrote {', '.join(str(w.relative_to(args.out)) for w in written)} in {args.out}")
            return 0
        if any(u < 1 for u in args.users) or args.duration < 1 or (args.requests is not None and args.requests < 1):
            raise SweepError("--users, --duration and --requests must be positive")
        if args.rates is not None and (any(r <= 0 for r in args.rates) or args.max_in_flight < 1
                                       or args.warmup_s < 0):
            raise SweepError("--rates and --max-in-flight must be positive, --warmup-s >= 0")
        if any(x is not None and x <= 0 for x in (args.slo_ttft, args.slo_tpot)):
            raise SweepError("--slo-ttft and --slo-tpot must be positive milliseconds")
        if args.temperature is not None and args.temperature < 0:
            raise SweepError("--temperature must be >= 0")
        if args.dataset is not None:
            try:
                load_requests(args.dataset)
            except DatasetError as e:
                raise SweepError(f"--dataset {e}") from None
        return sweep(args)
    except SweepError as e:
        print(f"sweep: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        log(f"interrupted; partial results in {args.out}/results.json (python -m loadtest.sweep --report-only "
            f"--out {args.out} writes their report)")
        return 130


if __name__ == "__main__":
    sys.exit(main())
