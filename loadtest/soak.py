"""Soak test (not a pytest test): many streaming users for a long time with normal requests, clients that vanish
mid-stream and malformed requests, then proof that nothing was left behind.

    python -m loadtest.soak                                   # starts the adaptive CPU server itself, 10 minutes
    python -m loadtest.soak --duration 120 --out /tmp/soak.json
    python -m loadtest.soak --url http://127.0.0.1:30000 --api-key "$KEY"   # an already running server

Every user loops until the time is up, picking per request: a normal streaming chat (checked strictly: 200,
well-formed SSE, `[DONE]`, a usage chunk), a disconnect (the client closes the socket 0.05-2 s into the stream)
or a malformed request from `loadtest/faults.py` (must get its 4xx with an OpenAI-style error body). After the
load it checks:

- no unexpected failure of any kind (a normal request that failed, a bad request answered with the wrong status
  or shape, a disconnect that saw a 5xx, the server gone);
- the server is idle within `--idle-timeout` s: nothing running or queued and no KV cache held, both in the
  scheduler's live view (`/v1/loads`) and in the exported gauges; a new request is answered;
- no growth: RSS of the whole server process tree and live KV usage after the load vs. after the warm-up
  (`--warmup`, default 20% of the run), within `--rss-tolerance-mb` / `--rss-tolerance`;
- metrics counters consistent with what the clients saw: 200 responses on the chat endpoint = normal +
  disconnected requests, requests and generated/prompt tokens at least what completed requests reported, DFlash's
  per-step counters agreeing with each other; and no traceback or prompt text in the server log (own server).

Prints a report and writes it as JSON (`--out`); exits 1 when a check fails.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from loadtest import faults, server_metrics
from loadtest.dataset import load_prompts
from loadtest.soak_args import add_soak_flags
from loadtest.sse import ChatStreamParser, StreamError

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "deploy" / "configs" / "cpu-docker.yaml"   # the embedded default, dflash_adaptive
MARKER = "soak-canary-5e0c2d"  # in every prompt: must never appear in the server log


@dataclass
class Tally:
    kinds: Counter = field(default_factory=Counter)          # requests started, by kind
    outcomes: Counter = field(default_factory=Counter)       # "kind:outcome"
    failures: list[dict] = field(default_factory=list)       # unexpected, with details (first 50 kept)
    failure_count: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    latencies: list[float] = field(default_factory=list)
    bad_statuses: Counter = field(default_factory=Counter)

    def fail(self, kind: str, what: str, **detail) -> None:
        self.failure_count += 1
        self.outcomes[f"{kind}:FAILED"] += 1
        if len(self.failures) < 50:
            self.failures.append({"kind": kind, "what": what, "t": round(time.time(), 3), **detail})


# ---------------------------------------------------------------------------------------------- the users


async def normal_request(client: httpx.AsyncClient, url: str, headers: dict, model: str, messages: list,
                         max_tokens: int, tally: Tally) -> None:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.monotonic()
    parser = ChatStreamParser(start)
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                text = (await r.aread())[:300].decode("utf-8", "replace")
                return tally.fail("normal", f"status {r.status_code}", body=text)
            async for line in r.aiter_lines():
                parser.feed(line, time.monotonic())
        timings = parser.finish(time.monotonic())
    except StreamError as e:
        return tally.fail("normal", f"bad stream: {e}")
    except (httpx.HTTPError, OSError) as e:
        return tally.fail("normal", f"transport: {type(e).__name__}: {e}")
    usage = getattr(parser, "_usage", None) or {}  # the usage chunk the parser validated
    tally.prompt_tokens += int(usage.get("prompt_tokens") or 0)
    tally.completion_tokens += timings.output_tokens
    tally.latencies.append(timings.e2e)
    tally.outcomes["normal:ok"] += 1


async def disconnect_request(url: str, headers: dict, model: str, content: str, rng: random.Random,
                             tally: Tally) -> None:
    body = faults.chat_body(model, content, 400, ignore_eos=True)
    try:
        d = await faults.stream_and_drop(f"{url}/v1/chat/completions", body, headers,
                                         drop_after=rng.uniform(0.05, 2.0))
    except OSError as e:
        return tally.fail("disconnect", f"transport: {type(e).__name__}: {e}")
    if d.status not in (None, 200):
        return tally.fail("disconnect", f"status {d.status}")
    tally.outcomes[f"disconnect:{'mid-stream' if d.streaming else 'before-first-chunk'}"] += 1


async def bad_request(client: httpx.AsyncClient, url: str, headers: dict, bad: faults.BadRequest,
                      tally: Tally) -> None:
    h = dict(headers)
    if bad.content_type:
        h["Content-Type"] = bad.content_type
    try:
        r = await client.request(bad.method, url + bad.path, content=bad.body if bad.method != "GET" else None,
                                 headers=h)
    except (httpx.HTTPError, OSError) as e:
        return tally.fail("bad", f"{bad.name}: transport: {type(e).__name__}: {e}")
    tally.bad_statuses[r.status_code] += 1
    if r.status_code not in bad.expect:
        return tally.fail("bad", f"{bad.name}: status {r.status_code}, expected {bad.expect}",
                          body=r.text[:300])
    problem = faults.error_shape_problem(r.status_code, r.content)
    if problem:
        return tally.fail("bad", f"{bad.name}: {problem}")
    tally.outcomes["bad:ok"] += 1


async def user(uid: int, url: str, headers: dict, model: str, deadline: float, args, prompts, bads,
               tally: Tally) -> None:
    rng = random.Random(args.seed * 1000 + uid)
    limits = httpx.Limits(max_connections=2, max_keepalive_connections=1)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout), limits=limits) as client:
        while time.monotonic() < deadline:
            roll = rng.random()
            if roll < args.disconnect_share:
                tally.kinds["disconnect"] += 1
                await disconnect_request(url, headers, model, f"{MARKER} {uid} " + rng.choice(prompts)[-1]["content"],
                                         rng, tally)
            elif roll < args.disconnect_share + args.bad_share:
                tally.kinds["bad"] += 1
                await bad_request(client, url, headers, rng.choice(bads), tally)
            else:
                tally.kinds["normal"] += 1
                messages = [dict(m) for m in rng.choice(prompts)]
                messages[-1]["content"] = f"{MARKER} {messages[-1]['content']}"
                await normal_request(client, url, headers, model, messages,
                                     rng.randint(args.max_tokens // 4, args.max_tokens), tally)
            if args.think_time:
                await asyncio.sleep(rng.uniform(0, 2 * args.think_time))


# ---------------------------------------------------------------------------------------------- observation


def server_rss_by_process(pid: int | None) -> dict[str, float]:
    """MiB of RSS per process of the server's tree (launcher, SGLang's HTTP process, scheduler, detokenizer)."""
    if pid is None:
        return {}
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    out: dict[str, float] = {}
    for p in procs:
        try:
            name = f"{p.pid}:{p.name()}"
            out[name] = round(p.memory_info().rss / 2**20, 1)
        except psutil.NoSuchProcess:
            pass
    return out


def server_tree_rss(pid: int | None) -> float | None:
    """MiB of RSS summed over the server's process tree. Early growth is first touch of the preallocated KV
    pool (SGLang allocates it untouched): take the baseline after the warm-up."""
    by_process = server_rss_by_process(pid)
    return sum(by_process.values()) if by_process else None


def listening_pid(port: int) -> int | None:
    try:
        for c in psutil.net_connections("tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                return c.pid
    except psutil.AccessDenied:
        return None
    return None


async def sampler(url: str, headers: dict, pid: int | None, stop: asyncio.Event, every: float,
                  timeline: list[dict], t0: float) -> None:
    while not stop.is_set():
        by_process = server_rss_by_process(pid)
        sample = {"t": round(time.monotonic() - t0, 1), "rss_mib": sum(by_process.values()) if by_process else None,
                  "rss_by_process": by_process}
        try:
            sample |= {f"live_{k}": v for k, v in (await asyncio.to_thread(faults.live_load, url, headers)).items()}
        except OSError as e:
            sample["error"] = f"{type(e).__name__}: {e}"
        timeline.append(sample)
        try:
            await asyncio.wait_for(stop.wait(), every)
        except asyncio.TimeoutError:
            pass


COUNTERS = ("sglang:num_requests_total", "sglang:generation_tokens_total", "sglang:prompt_tokens_total",
            "dflash_verify_steps_total", "dflash_committed_tokens_per_step_count",
            "dflash_committed_tokens_per_step_sum", "dflash_accepted_tokens_total")


def chat_200(snap) -> float:
    for labels, value in (snap or {}).get("sglang:http_responses_total", []):
        if labels.get("endpoint") == "/v1/chat/completions" and labels.get("status_code") == "200" \
                and labels.get("method") == "POST":
            return value
    return 0.0


def counters(snap) -> dict[str, float | None]:
    return {name: server_metrics.total(snap, name) for name in COUNTERS} | {"chat_200": chat_200(snap)}


# ---------------------------------------------------------------------------------------------- the run


def start_server(config: Path, workdir: Path, api_key: str | None):
    from service.config import load_config
    from harness.server import ManagedServer

    cfg = load_config(config).model_dump(mode="json", exclude_none=True)
    env = None
    if api_key:
        cfg["server"]["api_key_env"] = "DFLASH_SOAK_API_KEY"
        env = {"DFLASH_SOAK_API_KEY": api_key}
    return ManagedServer(cfg, workdir, "soak", env=env).start()


def check(name: str, ok: bool, detail: str, checks: list[dict]) -> None:
    checks.append({"check": name, "ok": bool(ok), "detail": detail})


async def run(args) -> dict:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dflash-soak-"))
    server = None
    if args.url:
        url = args.url.rstrip("/")
        pid = args.pid or listening_pid(int(url.rsplit(":", 1)[1]))
    else:
        print(f"soak: starting a server from {args.config} (log in {workdir})", flush=True)
        server = start_server(Path(args.config), workdir, args.api_key)
        url, pid = server.url, server.proc.pid
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        return await _soak(args, url, headers, pid, server)
    finally:
        if server is not None:
            server.stop()


async def _soak(args, url: str, headers: dict, pid: int | None, server) -> dict:
    models = json.loads(faults.send(url, "GET", "/v1/models", None, headers)[1])
    model = models["data"][0]["id"]
    context = int(models["data"][0].get("max_model_len") or 4096)
    prompts = load_prompts(args.dataset)
    bads = faults.bad_requests(model, context) + [
        faults.BadRequest("oversized body", "/v1/chat/completions",
                          faults.oversized_body(model, args.oversized_bytes), expect=(413,))]
    tally, timeline, checks = Tally(), [], []
    before = counters(server_metrics.scrape(url))
    t0 = time.monotonic()
    deadline = t0 + args.duration
    stop = asyncio.Event()
    sampling = asyncio.create_task(sampler(url, headers, pid, stop, args.sample_every, timeline, t0))
    print(f"soak: {args.users} users for {args.duration:.0f}s against {url} (model {model}, context {context})",
          flush=True)

    async def progress():
        while time.monotonic() < deadline:
            await asyncio.sleep(min(30, args.duration))
            print(f"soak: t={time.monotonic() - t0:5.0f}s requests {dict(tally.kinds)} "
                  f"unexpected failures {tally.failure_count}", flush=True)

    reporter = asyncio.create_task(progress())
    await asyncio.gather(*(user(i, url, headers, model, deadline, args, prompts, bads, tally)
                           for i in range(args.users)))
    load_end = time.monotonic()
    reporter.cancel()

    idle, took, state = await asyncio.to_thread(faults.wait_idle, url, headers, args.idle_timeout)
    check("idle after load", idle, f"{took:.1f}s after the last request: {state}", checks)
    status, body = await asyncio.to_thread(
        faults.send, url, "POST", "/v1/chat/completions",
        json.dumps(faults.chat_body(model, "def add(a, b):", 8, stream=False)).encode(),
        {**headers, "Content-Type": "application/json"})
    check("serves after load", status == 200, f"status {status}", checks)
    await asyncio.sleep(args.settle)
    stop.set()
    await sampling
    after = counters(server_metrics.scrape(url))
    final_rss = server_tree_rss(pid)
    final_live = await asyncio.to_thread(faults.live_load, url, headers)

    # ---- no unexpected failures
    check("no unexpected failures", tally.failure_count == 0,
          f"{tally.failure_count} unexpected failures" + (f"; first: {tally.failures[0]}" if tally.failures else ""),
          checks)

    # ---- growth
    warm = [s for s in timeline if s["t"] >= args.warmup * args.duration and s.get("rss_mib")]
    if warm and final_rss is not None:
        base = warm[0]["rss_mib"]
        allowed = max(args.rss_tolerance_mb, args.rss_tolerance * base)
        check("no RSS growth", final_rss - base <= allowed,
              f"server tree RSS {base:.0f} MiB after warm-up (t={warm[0]['t']}s), {final_rss:.0f} MiB after the "
              f"load (peak {max(s['rss_mib'] for s in warm):.0f}); allowed growth {allowed:.0f} MiB", checks)
    else:
        check("no RSS growth", True, "not measured (no server pid: pass --pid)", checks)
    check("no KV growth", final_live["num_used_tokens"] == 0 and final_live["token_usage"] == 0,
          f"live KV after the load: {final_live}", checks)

    # ---- counters
    d = {k: (after[k] - (before[k] or 0)) if after[k] is not None else None for k in after}
    reached = tally.kinds["normal"] + tally.kinds["disconnect"]
    sanity = 1
    check("200s on the chat endpoint = normal + disconnected requests (+1 after-load check)",
          d["chat_200"] == reached + sanity,
          f"server counted {d['chat_200']:.0f}, clients sent {reached} + {sanity}", checks)
    nreq = d["sglang:num_requests_total"]
    ok_normal = tally.outcomes["normal:ok"]
    check("requests counted", nreq is not None and ok_normal + sanity <= nreq <= reached + sanity,
          f"sglang:num_requests_total +{nreq}; completed normal {ok_normal}, all generation requests "
          f"{reached} (+{sanity})", checks)
    gen = d["sglang:generation_tokens_total"]
    check("generated tokens at least what clients received", gen is not None and gen >= tally.completion_tokens,
          f"sglang:generation_tokens_total +{gen}; completed requests reported {tally.completion_tokens}", checks)
    ptok = d["sglang:prompt_tokens_total"]
    check("prompt tokens at least what clients sent", ptok is not None and ptok >= tally.prompt_tokens,
          f"sglang:prompt_tokens_total +{ptok}; completed requests reported {tally.prompt_tokens}", checks)
    if d["dflash_verify_steps_total"] is not None:
        check("DFlash step counters agree",
              d["dflash_committed_tokens_per_step_count"] == d["dflash_verify_steps_total"]
              and d["dflash_committed_tokens_per_step_sum"] == d["dflash_verify_steps_total"]
              + d["dflash_accepted_tokens_total"],
              f"verify steps {d['dflash_verify_steps_total']}, committed count "
              f"{d['dflash_committed_tokens_per_step_count']}, committed sum "
              f"{d['dflash_committed_tokens_per_step_sum']}, accepted {d['dflash_accepted_tokens_total']}", checks)

    # ---- the log (own server only)
    if server is not None:
        log = server.log_path.read_text(errors="replace")
        check("no traceback in the server log", "Traceback" not in log,
              f"{log.count('Traceback')} tracebacks in {server.log_path}", checks)
        check("no prompt text in the server log", MARKER not in log,
              f"marker {MARKER!r} found {log.count(MARKER)} times in {server.log_path}", checks)

    lat = sorted(tally.latencies)
    return {
        "url": url, "model": model, "users": args.users, "duration_s": args.duration,
        "load_seconds": round(load_end - t0, 1),
        "requests": dict(tally.kinds), "outcomes": dict(tally.outcomes),
        "bad_input_statuses": {str(k): v for k, v in sorted(tally.bad_statuses.items())},
        "unexpected_failures": tally.failure_count, "failure_samples": tally.failures,
        "normal_latency_s": {"p50": round(statistics.median(lat), 3) if lat else None,
                             "p99": round(lat[int(0.99 * (len(lat) - 1))], 3) if lat else None},
        "completion_tokens": tally.completion_tokens,
        "counter_deltas": d, "final_rss_mib": final_rss, "final_live": final_live,
        "timeline": timeline, "checks": checks, "passed": all(c["ok"] for c in checks),
    }


def print_report(report: dict) -> None:
    print("\n=== soak report ===")
    print(f"{report['users']} users, {report['load_seconds']}s of load against {report['url']} ({report['model']})")
    print(f"requests: {report['requests']}")
    print(f"outcomes: {report['outcomes']}")
    print(f"bad-input statuses: {report['bad_input_statuses']}")
    print(f"normal-request latency: {report['normal_latency_s']}; completion tokens {report['completion_tokens']}")
    samples = [s for s in report["timeline"] if s.get("rss_mib")]
    if samples:
        rss = [s["rss_mib"] for s in samples]
        print(f"server RSS MiB: first {rss[0]:.0f}, min {min(rss):.0f}, max {max(rss):.0f}, "
              f"final {report['final_rss_mib']:.0f}")
        first, last = samples[0]["rss_by_process"], samples[-1]["rss_by_process"]
        print("  by process (first -> last sample): " + ", ".join(
            f"{name.split(':', 1)[1]} {first.get(name, 0):.0f} -> {mib:.0f}" for name, mib in last.items()))
    for c in report["checks"]:
        print(f"  [{'PASS' if c['ok'] else 'FAIL'}] {c['check']}: {c['detail']}")
    print(f"=== {'PASSED' if report['passed'] else 'FAILED'} ===")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--url", help="an already running server (default: start one from --config)")
    src.add_argument("--config", default=str(DEFAULT_CONFIG),
                     help="dflash-serve config to start (default: %(default)s)")
    p.add_argument("--pid", type=int,
                   help="with --url: the server's pid for RSS (default: whoever listens on the port)")
    p.add_argument("--api-key", default=os.environ.get("DFLASH_SOAK_API_KEY"),
                   help="bearer key (with --config: the started server requires it)")
    add_soak_flags(p, idle_timeout=30, idle_help="seconds the server may take to be idle")
    p.add_argument("--workdir", help="where a started server writes its config and log")
    p.add_argument("--out", default="soak-report.json", help="JSON report (default: %(default)s)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    report = asyncio.run(run(args))
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    print_report(report)
    print(f"report: {args.out}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
