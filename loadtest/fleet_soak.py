"""Fault soak of a fleet (not a pytest test): many users through SGLang's router for a long time under KV pressure,
while a replica is killed and restarted, clients vanish mid-stream and bad bodies arrive; then the tally.

    python -m loadtest.fleet_soak                                  # 50 users, 10 min, deploy/configs/cpu.yaml
    python -m loadtest.fleet_soak --users 6 --duration 60 --out /tmp/fleet-soak.json

It starts `dflash-serve fleet` (2 replicas, `harness/server.py ManagedFleet`) from `--config` with a small KV pool
(`--max-total-tokens`: decode retracts), then runs `--users` closed-loop users (as Locust users loop) against the
router; each picks per request a normal streaming chat (checked strictly: 200, well-formed SSE, `[DONE]`, usage),
a disconnect (the client closes the socket 0.05-2 s into the stream) or a bad body (`loadtest/faults.py`: malformed
JSON and fields, a body over the size limit). At each `--kill-at` fraction of the run it SIGKILLs one replica's
server (its whole process group, no drain), then waits until the fleet restarted it and the router lists it healthy.

The users' client is httpx with a small pool (2 connections, 1 kept alive), as an application's would be, and like
the `openai` SDK it retries, once and on a fresh connection, a request that got no response at all (its connection
was closed, reset or broken before a status line: `STALE_CONNECTION`). sglang-router closes a keep-alive connection
after refusing a body it had not read (a wrong or missing Content-Type is refused from the headers, and hyper closes
rather than wait for the rest), with no `Connection: close` in the answer, so the user's next request can go out
before the close arrives. The retries are reported by the user's request before them (`retried`); a retry that
fails too is the request's failure.

How each request is classified:
- *unexpected*: a normal request that is not a complete stream (a 5xx, another non-200, a dropped or malformed
  stream, a transport error) unless it is counted as killed in flight; a disconnect that got a status other than
  200; a bad body answered with anything but a 4xx, or not at all.
- *killed in flight* (expected): a normal request or disconnect that was in flight at a kill and failed after it.
  The client cannot see which replica served it, so per kill at most as many as the killed replica was running or
  queueing just before the kill (its `/v1/loads`, plus the users who started a request in the 1 s around the read)
  are counted so; any beyond that are unexpected. A request sent after the kill that fails is unexpected: the
  other replica is up the whole time.
- *lost*: sent and never answered: still open `--drain-timeout` s after the load ended, or timed out
  (`--request-timeout`) without a status line.

It samples every process of the fleet (the fleet, the router, each replica's launcher and SGLang processes) for RSS
every `--sample-every` s, and after the load checks each replica idle (nothing running or queued, no KV held) and
RSS flat: per role, the sample after the warm-up (or after the role's last restart and the warm-up) against the
last, within `--rss-tolerance-mb` or `--rss-tolerance` of the baseline. Prints a table, writes JSON (`--out`,
default under benchmarks/results/fleet-soak/), exits 1 when a check fails.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import psutil
import yaml

from loadtest import faults, server_metrics
from loadtest.dataset import load_prompts
from loadtest.soak_args import add_soak_flags
from loadtest.sse import ChatStreamParser, StreamError

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "deploy" / "configs" / "cpu.yaml"
RESULTS = REPO / "benchmarks" / "results" / "fleet-soak"
KEY_ENV, ADMIN_ENV = "DFLASH_FLEET_SOAK_KEY", "DFLASH_FLEET_SOAK_ADMIN_KEY"
RETRACTED = "sglang:num_retracted_requests_total"
REQUESTS = "sglang:num_requests_total"


@dataclass
class Outcome:
    """One request as its client saw it. Times in seconds from the start of the load."""

    kind: str                      # normal | disconnect | bad
    start: float
    end: float | None = None       # None: never answered
    status: int | None = None
    result: str = "ok"             # ok | failed | lost
    what: str = ""
    tokens: int = 0
    klass: str = ""                # after the run: ok | unexpected | killed-in-flight | lost
    previous: str = ""             # the same user's request before it, on the same connection pool: kind, status
    retried: str = ""              # the transport error of a first attempt that got no response (see `retrying`)


@dataclass
class Kill:
    replica: int
    t: float                       # when the SIGKILL went out
    in_flight: int                 # running + queued on the victim just before
    started_near: int = 0          # requests started within 1 s before the kill (may have been routed there)
    healthy_again: float | None = None   # the restarted replica answers /health
    router_again: float | None = None    # the router lists it healthy
    killed_in_flight: int = 0      # outcomes classified so


@dataclass
class Run:
    outcomes: list[Outcome] = field(default_factory=list)
    open: set = field(default_factory=set)        # id() of outcomes still waiting for an answer
    kills: list[Kill] = field(default_factory=list)
    timeline: list[dict] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------- requests


# A request that got no response at all: the pooled connection it went out on had been closed by the router after
# its previous answer (the module docstring says when). Real clients retry these on a fresh connection (the openai
# SDK: `max_retries`, 2 by default).
STALE_CONNECTION = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


async def retrying(attempt, o: Outcome):
    """`attempt(o)`, and once more on a fresh connection when it failed with STALE_CONNECTION before any status
    arrived (httpx drops the broken connection from the pool); the first error is kept in `o.retried`."""
    try:
        return await attempt(o)
    except STALE_CONNECTION as e:
        if o.status is not None:
            raise
        o.retried = f"{type(e).__name__}: {e}"
    return await attempt(o)


async def normal(client: httpx.AsyncClient, url: str, headers: dict, model: str, messages: list, max_tokens: int,
                 o: Outcome) -> None:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}

    async def attempt(o: Outcome) -> None:
        parser = ChatStreamParser(time.monotonic())
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
            o.status = r.status_code
            if r.status_code != 200:
                o.result, o.what = "failed", f"status {r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                parser.feed(line, time.monotonic())
        o.tokens = parser.finish(time.monotonic()).output_tokens

    try:
        await retrying(attempt, o)
    except StreamError as e:
        o.result, o.what = "failed", f"bad stream: {e}"
    except httpx.TimeoutException as e:
        o.result, o.what = ("lost" if o.status is None else "failed"), f"timeout: {type(e).__name__}"
    except (httpx.HTTPError, OSError) as e:
        o.result, o.what = "failed", f"transport: {type(e).__name__}: {e}"


async def disconnect(url: str, headers: dict, model: str, content: str, rng: random.Random, o: Outcome,
                     timeout: float) -> None:
    body = faults.chat_body(model, content, 400, ignore_eos=True)
    try:
        d = await asyncio.wait_for(faults.stream_and_drop(f"{url}/v1/chat/completions", body, headers,
                                                          drop_after=rng.uniform(0.05, 2.0)), timeout)
    except asyncio.TimeoutError:
        o.result, o.what = "lost", "timeout"
        return
    except OSError as e:
        o.result, o.what = "failed", f"transport: {type(e).__name__}: {e}"
        return
    o.status = d.status
    if d.status not in (None, 200):
        o.result, o.what = "failed", f"status {d.status}"
    else:
        o.what = "mid-stream" if d.streaming else "before-first-chunk"


async def bad(client: httpx.AsyncClient, url: str, headers: dict, req: faults.BadRequest, o: Outcome) -> None:
    h = dict(headers)
    if req.content_type:
        h["Content-Type"] = req.content_type
    o.what = req.name

    async def attempt(o: Outcome) -> httpx.Response:
        return await client.request(req.method, url + req.path, content=req.body if req.method != "GET" else None,
                                    headers=h)

    try:
        r = await retrying(attempt, o)
    except httpx.TimeoutException:
        o.result = "lost"
        return
    except (httpx.HTTPError, OSError) as e:
        o.result, o.what = "failed", f"{req.name}: transport: {type(e).__name__}: {e}"
        return
    o.status = r.status_code
    if not 400 <= r.status_code < 500:  # through the router any 4xx is the answer; its exact code is reported
        o.result, o.what = "failed", f"{req.name}: status {r.status_code}: {r.text[:200]!r}"


async def user(uid: int, url: str, headers: dict, model: str, deadline: float, t0: float, args, prompts, bads,
               run: Run) -> None:
    rng = random.Random(args.seed * 1000 + uid)
    limits = httpx.Limits(max_connections=2, max_keepalive_connections=1)
    previous = ""
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout), limits=limits) as client:
        while time.monotonic() < deadline:
            roll = rng.random()
            kind = ("disconnect" if roll < args.disconnect_share
                    else "bad" if roll < args.disconnect_share + args.bad_share else "normal")
            o = Outcome(kind, time.monotonic() - t0, previous=previous)
            run.outcomes.append(o)
            run.open.add(id(o))
            try:
                if kind == "disconnect":
                    await disconnect(url, headers, model, rng.choice(prompts)[-1]["content"], rng, o,
                                     args.request_timeout)
                elif kind == "bad":
                    await bad(client, url, headers, rng.choice(bads), o)
                else:
                    await normal(client, url, headers, model, [dict(m) for m in rng.choice(prompts)],
                                 rng.randint(args.max_tokens // 4, args.max_tokens), o)
            finally:
                run.open.discard(id(o))
                o.end = time.monotonic() - t0
                previous = f"{kind} {o.status} {o.what[:80]}".strip()
            if args.think_time:
                await asyncio.sleep(rng.uniform(0, 2 * args.think_time))


# ---------------------------------------------------------------------------------------------- the fleet


def fleet_config(path: Path, max_total_tokens: int | None) -> dict:
    """The config with its model paths made absolute (ManagedFleet writes it elsewhere) and the small KV pool."""
    config = yaml.safe_load(path.read_text())
    for section, key in (("model", "path"), ("speculative", "draft_model_path")):
        value = (config.get(section) or {}).get(key)
        if value and not Path(value).is_absolute():
            config[section][key] = str((path.parent / value).resolve())
    config["server"] |= {"api_key_env": KEY_ENV, "admin_api_key_env": ADMIN_ENV}
    if max_total_tokens:
        config["server"]["max_total_tokens"] = max_total_tokens
    return config


def roles(fleet_pid: int) -> dict[int, tuple[str, str]]:
    """pid -> (role, process name) for every process of the fleet: fleet, router, replica-i."""
    out: dict[int, tuple[str, str]] = {}
    try:
        root = psutil.Process(fleet_pid)
        out[root.pid] = ("fleet", "fleet")
        for child in root.children():
            cmd = " ".join(child.cmdline())  # the router renames itself sglang::router
            role = "router" if "router" in cmd else next(
                (f"replica-{i}" for i in range(64) if f"replica-{i}.yaml" in cmd), "other")
            for p in (child, *child.children(recursive=True)):
                out[p.pid] = (role, p.name())
    except psutil.NoSuchProcess:
        pass
    return out


def rss_sample(fleet_pid: int) -> dict[str, dict[str, float]]:
    """role -> {"pid:name": MiB}."""
    out: dict[str, dict[str, float]] = {}
    for pid, (role, name) in roles(fleet_pid).items():
        try:
            out.setdefault(role, {})[f"{pid}:{name}"] = round(psutil.Process(pid).memory_info().rss / 2**20, 1)
        except psutil.NoSuchProcess:
            pass
    return out


def replica_server_pid(fleet_pid: int, index: int) -> int:
    """The SGLang server process of replica `index` (its launcher's child): kill its group to crash it."""
    launcher = next(p for p in psutil.Process(fleet_pid).children()
                    if any(a.endswith(f"replica-{index}.yaml") for a in p.cmdline()))
    return launcher.children()[0].pid


def healthy(url: str) -> bool:
    try:
        return faults.send(url, "GET", "/health", None, timeout=5)[0] == 200
    except OSError:
        return False


async def sampler(fleet, stop: asyncio.Event, every: float, run: Run, t0: float) -> None:
    while not stop.is_set():
        sample: dict = {"t": round(time.monotonic() - t0, 1), "rss": await asyncio.to_thread(rss_sample, fleet.proc.pid)}
        for i, u in enumerate(fleet.replica_urls):
            snap = await asyncio.to_thread(server_metrics.scrape, u, None, 10)
            # a counter appears with its first increment; None: the replica did not answer (down)
            sample[f"retracted-{i}"] = (server_metrics.total(snap, RETRACTED) or 0.0) if snap else None
            sample[f"requests-{i}"] = (server_metrics.total(snap, REQUESTS) or 0.0) if snap else None
        run.timeline.append(sample)
        try:
            await asyncio.wait_for(stop.wait(), every)
        except asyncio.TimeoutError:
            pass


async def killer(fleet, at: list[float], first: int, t0: float, run: Run, restart_timeout: float) -> None:
    for n, when in enumerate(at):
        await asyncio.sleep(max(0.0, t0 + when - time.monotonic()))
        index = (first + n) % len(fleet.replica_urls)
        url = fleet.replica_urls[index]
        try:
            load = await asyncio.to_thread(faults.live_load, url, fleet.headers)
            in_flight = int(load["num_running_reqs"] + load["num_waiting_reqs"])
        except OSError:
            in_flight = 0
        now = time.monotonic() - t0
        kill = Kill(index, now, in_flight,
                    started_near=sum(1 for o in run.outcomes if now - 1.0 <= o.start <= now and o.kind != "bad"))
        os.killpg(replica_server_pid(fleet.proc.pid, index), signal.SIGKILL)  # a crash: no drain
        run.kills.append(kill)
        print(f"fleet-soak: t={now:.0f}s killed replica-{index} ({in_flight} requests on it)", flush=True)
        deadline = time.monotonic() + restart_timeout
        while time.monotonic() < deadline and not await asyncio.to_thread(healthy, url):
            await asyncio.sleep(1)
        kill.healthy_again = time.monotonic() - t0
        while time.monotonic() < deadline:
            try:
                if (await asyncio.to_thread(fleet.workers)).get(url):
                    kill.router_again = time.monotonic() - t0
                    break
            except OSError:
                pass
            await asyncio.sleep(1)
        print(f"fleet-soak: replica-{index} serves again at t={kill.healthy_again:.0f}s, in the router's "
              f"rotation at t={kill.router_again}", flush=True)


# ---------------------------------------------------------------------------------------------- the tally


def classify(run: Run) -> None:
    for o in run.outcomes:
        o.klass = "ok" if o.result == "ok" else "lost" if o.result == "lost" else "unexpected"
    for k in run.kills:
        budget = k.in_flight + k.started_near
        hit = sorted((o for o in run.outcomes if o.klass == "unexpected" and o.kind != "bad"
                      and o.start <= k.t <= (o.end if o.end is not None else float("inf"))), key=lambda o: o.start)
        for o in hit[:budget]:
            o.klass = "killed-in-flight"
        k.killed_in_flight = min(budget, len(hit))


def role_restarts(run: Run) -> dict[str, float]:
    """role -> when its latest process started serving (a killed replica: when it was healthy again)."""
    return {f"replica-{k.replica}": k.healthy_again or k.t for k in run.kills}


def rss_checks(run: Run, args, load_seconds: float) -> tuple[list[dict], dict]:
    checks, per_role = [], {}
    restarts = role_restarts(run)
    samples = [s for s in run.timeline if s.get("rss")]
    all_roles = sorted({r for s in samples for r in s["rss"]})
    for role in all_roles:
        series = [(s["t"], sum(s["rss"][role].values())) for s in samples if role in s["rss"]]
        after = max(args.warmup * load_seconds, restarts.get(role, 0) + args.warmup * load_seconds / 2)
        warm = [(t, v) for t, v in series if t >= after]
        if not warm:
            continue
        base, final, peak = warm[0][1], series[-1][1], max(v for _, v in warm)
        allowed = max(args.rss_tolerance_mb, args.rss_tolerance * base)
        per_role[role] = {"baseline_t": warm[0][0], "baseline_mib": round(base), "peak_mib": round(peak),
                          "final_mib": round(final), "growth_mib": round(final - base), "allowed_mib": round(allowed)}
        checks.append({"check": f"RSS flat: {role}", "ok": final - base <= allowed,
                       "detail": f"{base:.0f} MiB at t={warm[0][0]}s, {final:.0f} MiB at the end (peak {peak:.0f}), "
                                 f"allowed growth {allowed:.0f}"})
    return checks, per_role


def counted(run: Run, replica: int, name: str = "retracted") -> int:
    """How much a replica's counter (sampled as `name-i`) grew over the run; a restart resets it."""
    total, prev = 0, None
    for s in run.timeline:
        v = s.get(f"{name}-{replica}")
        if v is None:
            continue
        total += int(v - prev) if prev is not None and v >= prev else int(v) if prev is not None else 0
        prev = v
    return total


# ---------------------------------------------------------------------------------------------- the run


async def soak(args) -> dict:
    from harness.server import ManagedFleet

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="dflash-fleet-soak-"))
    keys = {KEY_ENV: "sk-soak-" + os.urandom(8).hex(), ADMIN_ENV: "sk-soak-admin-" + os.urandom(8).hex()}
    env = dict(keys)
    if args.retract_interval:  # SGLang's forced retraction: a real storm of retract/re-prefill on every replica
        env |= {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": str(args.retract_interval)}
    fleet = ManagedFleet(fleet_config(Path(args.config), args.max_total_tokens), workdir, "fleet-soak",
                         replicas=args.replicas, env=env)
    print(f"fleet-soak: starting {args.replicas} replicas of {args.config} (log in {fleet.log_path})", flush=True)
    started = time.monotonic()
    fleet.start()
    startup = time.monotonic() - started
    try:
        return await run_against(args, fleet, startup)
    finally:
        fleet.stop()


async def run_against(args, fleet, startup: float | None = None) -> dict:
    """The soak against a started `ManagedFleet` (one with an API and an admin key): the report."""
    url, headers = fleet.url, fleet.headers
    model = json.loads(faults.send(url, "GET", "/v1/models", None, headers)[1])["data"][0]["id"]
    prompts = load_prompts(args.dataset)
    bads = faults.bad_requests(model, args.context) + [
        faults.BadRequest("oversized body", "/v1/chat/completions", faults.oversized_body(model, args.oversized_bytes),
                          expect=(413,))]
    run = Run()
    t0 = time.monotonic()
    deadline = t0 + args.duration
    stop = asyncio.Event()
    sampling = asyncio.create_task(sampler(fleet, stop, args.sample_every, run, t0))
    kills = asyncio.create_task(killer(fleet, [f * args.duration for f in args.kill_at], args.first_replica, t0, run,
                                       args.restart_timeout))
    print(f"fleet-soak: {args.users} users for {args.duration:.0f}s through {url} (model {model})", flush=True)

    async def progress():
        while True:
            await asyncio.sleep(min(30, args.duration))
            by = Counter(f"{o.kind}:{o.result}" for o in run.outcomes if id(o) not in run.open)
            print(f"fleet-soak: t={time.monotonic() - t0:5.0f}s {dict(by)} open {len(run.open)}", flush=True)

    reporter = asyncio.create_task(progress())
    users = [asyncio.create_task(user(i, url, headers, model, deadline, t0, args, prompts, bads, run))
             for i in range(args.users)]
    await asyncio.sleep(max(0.0, deadline - time.monotonic()))
    load_end = time.monotonic() - t0
    done, pending = await asyncio.wait(users, timeout=args.drain_timeout)
    for task in pending:
        task.cancel()
    for o in run.outcomes:  # still open after the drain: never answered
        if id(o) in run.open:
            o.result, o.what = "lost", "no answer by the end of the drain"
    reporter.cancel()
    await kills  # a restart still under way is waited for (its own timeout)

    checks: list[dict] = []
    idle = {}
    for i, u in enumerate(fleet.replica_urls):
        ok, took, state = await asyncio.to_thread(faults.wait_idle, u, headers, args.idle_timeout)
        idle[f"replica-{i}"] = state
        checks.append({"check": f"replica-{i} idle after the load", "ok": ok,
                       "detail": f"{took:.1f}s after the drain: {state}"})
    status, _ = await asyncio.to_thread(
        faults.send, url, "POST", "/v1/chat/completions",
        json.dumps(faults.chat_body(model, "def add(a, b):", 8, stream=False)).encode(),
        {**headers, "Content-Type": "application/json"})
    checks.append({"check": "serves after the load", "ok": status == 200, "detail": f"status {status}"})
    await asyncio.sleep(args.settle)
    stop.set()
    await sampling

    classify(run)
    klass = Counter(o.klass for o in run.outcomes)
    unexpected = [o for o in run.outcomes if o.klass == "unexpected"]
    lost = [o for o in run.outcomes if o.klass == "lost"]
    checks.append({"check": "no unexpected errors", "ok": not unexpected,
                   "detail": f"{len(unexpected)}" + (f"; first: {asdict(unexpected[0])}" if unexpected else "")})
    checks.append({"check": "no lost requests", "ok": not lost,
                   "detail": f"{len(lost)}" + (f"; first: {asdict(lost[0])}" if lost else "")})
    checks.append({"check": "every kill restarted and rejoined the router", "ok":
                   len(run.kills) == len(args.kill_at) and all(k.router_again is not None for k in run.kills),
                   "detail": "; ".join(f"replica-{k.replica} killed at {k.t:.0f}s, healthy at {k.healthy_again}, "
                                       f"routed at {k.router_again}" for k in run.kills)})
    rss, per_role = rss_checks(run, args, load_end)
    checks += rss
    normal_ok = [o for o in run.outcomes if o.kind == "normal" and o.klass == "ok"]
    lat = sorted(o.end - o.start for o in normal_ok)
    return {
        "config": str(args.config), "replicas": args.replicas, "users": args.users, "duration_s": args.duration,
        "max_total_tokens": args.max_total_tokens, "retract_interval": args.retract_interval, "fleet_startup_s": None if startup is None else round(startup, 1),
        "load_seconds": round(load_end, 1),
        "requests": dict(Counter(o.kind for o in run.outcomes)),
        "outcomes": dict(Counter(f"{o.kind}:{o.klass}" for o in run.outcomes)),
        "classes": dict(klass), "unexpected": len(unexpected), "lost": len(lost),
        "bad_statuses": {str(k): v for k, v in sorted(Counter(o.status for o in run.outcomes
                                                               if o.kind == "bad").items(), key=str)},
        "disconnects": dict(Counter(o.what for o in run.outcomes if o.kind == "disconnect" and o.klass == "ok")),
        # requests retried once on a fresh connection (`retrying`), by the same user's request before them
        "retried": dict(Counter(o.previous for o in run.outcomes if o.retried)),
        "retried_samples": [asdict(o) for o in run.outcomes if o.retried][:20],
        "completion_tokens": sum(o.tokens for o in normal_ok),
        "normal_latency_s": {"p50": round(statistics.median(lat), 2) if lat else None,
                             "p99": round(lat[int(0.99 * (len(lat) - 1))], 2) if lat else None},
        "retracted_requests": sum(counted(run, i) for i in range(len(fleet.replica_urls))),
        "requests_by_replica": [counted(run, i, "requests") for i in range(len(fleet.replica_urls))],
        "kills": [asdict(k) for k in run.kills], "rss_by_role": per_role, "idle": idle,
        "failure_samples": [asdict(o) for o in (unexpected + lost)[:50]],
        "killed_in_flight_samples": [asdict(o) for o in run.outcomes if o.klass == "killed-in-flight"][:20],
        "timeline": run.timeline, "checks": checks, "passed": all(c["ok"] for c in checks),
    }


def print_report(r: dict) -> None:
    print("\n=== fleet soak ===")
    print(f"{r['replicas']} replicas of {r['config']} (max_total_tokens {r['max_total_tokens']}), {r['users']} users, "
          f"{r['load_seconds']}s of load")
    rows = [("requests", r["requests"]), ("outcomes", r["outcomes"]), ("bad-body statuses", r["bad_statuses"]),
            ("disconnects", r["disconnects"]), ("retried on a fresh connection", r["retried"]),
            ("unexpected errors", r["unexpected"]), ("lost requests", r["lost"]),
            ("retracted requests", r["retracted_requests"]), ("requests by replica", r["requests_by_replica"]),
            ("completion tokens", r["completion_tokens"]),
            ("normal latency s", r["normal_latency_s"])]
    for k in r["kills"]:
        rows.append((f"kill replica-{k['replica']} t={k['t']:.0f}s",
                     f"{k['in_flight']} on it (+{k['started_near']} started within 1 s), "
                     f"{k['killed_in_flight']} failed in flight; healthy at {k['healthy_again']}, "
                     f"routed at {k['router_again']}"))
    for role, v in r["rss_by_role"].items():
        rows.append((f"RSS {role} MiB", f"{v['baseline_mib']} (t={v['baseline_t']}s) -> {v['final_mib']} "
                                        f"(peak {v['peak_mib']}, growth {v['growth_mib']:+d}, allowed {v['allowed_mib']})"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    for c in r["checks"]:
        print(f"  [{'PASS' if c['ok'] else 'FAIL'}] {c['check']}: {c['detail']}")
    print(f"=== {'PASSED' if r['passed'] else 'FAILED'} ===")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m loadtest.fleet_soak", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="dflash-serve config (default: %(default)s)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--max-total-tokens", type=int, default=2048,
                   help="each replica's KV pool, small enough that decode retracts (default: %(default)s)")
    p.add_argument("--retract-interval", type=int, default=25,
                   help="SGLang retracts decode requests every this many forward steps on each replica "
                        "(SGLANG_TEST_RETRACT; 0: only when the pool is really full)")
    p.add_argument("--kill-at", type=float, nargs="*", default=[0.3, 0.6],
                   help="fractions of the run at which a replica is killed, replica 0, 1, ... in turn")
    p.add_argument("--first-replica", type=int, default=0, help="the replica the first kill takes")
    p.add_argument("--context", type=int, default=4096, help="the model's context, for the over-long bodies")
    p.add_argument("--drain-timeout", type=float, default=300,
                   help="seconds after the load for open requests to be answered; later ones are lost")
    p.add_argument("--restart-timeout", type=float, default=300, help="seconds a killed replica has to rejoin")
    add_soak_flags(p, idle_timeout=60, idle_help="seconds a replica may take to be idle")
    p.add_argument("--workdir", help="where the fleet writes its configs and log")
    p.add_argument("--out", help=f"JSON report (default: {RESULTS.relative_to(REPO)}/fleet_soak_<users>u_<s>s.json)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    report = asyncio.run(soak(args))
    out = Path(args.out or RESULTS / f"fleet_soak_{args.users}u_{args.duration:.0f}s.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    print_report(report)
    print(f"report: {out}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
