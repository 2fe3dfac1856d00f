"""`dflash-serve fleet`: N replicas of one config behind SGLang's own router (`sglang-router`).

Why: one server is where users start; several behind a cache-aware router is where they stay. Routing, health
checks, retries and the fleet's request metrics are the router's; this module only derives each replica's
config, starts the processes, watches them and stops them.

Contract:
- `plan()` gives replica i the config with port `replica_base_port + i`, on CPU its share of the cores
  (`server.cpu_cores`, threads on that share), on GPU the device `fleet.gpus[i]` (CUDA_VISIBLE_DEVICES), and
  the router the config's port. Conflicts and impossible shares raise ConfigError naming the field.
- `run()` starts the router (it holds its port from the start and answers 503 until a replica is healthy) and
  every replica, and waits until each replica answers /health and the router lists every replica healthy, then
  prints `ready`. A process that exits, or a replica that outlasts `fleet.startup_timeout_seconds`, first stops
  the fleet (exit 1).
- Afterwards a replica (or the router) that exits is restarted, with backoff; the router's health checks take
  a dead replica out of rotation and put it back once it answers again.
- SIGTERM/SIGINT go once to the router and every replica: each drains its in-flight requests for
  `server.shutdown_grace_seconds` (new ones get 503). Exit 0 when every process stopped cleanly.

Invariants: the fleet never holds the API key on a command line (replicas and router read it from the
environment); every child runs in its own session, so a terminal's Ctrl-C reaches each child once, through us.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import yaml

from service import launcher, router_args
from service.config import ConfigError, Device, ServeConfig, available_cores
from sglang_ext import names

RESTART_BACKOFF = (1.0, 60.0)       # first and largest delay before restarting a process that exited
STABLE_SECONDS = 600.0              # a process up this long gets the first delay again when it next exits
KILL_MARGIN_SECONDS = 15.0        # after server.shutdown_grace_seconds, how long stop() waits before SIGKILL
STOPPED_CLEANLY = {0, -signal.SIGTERM, 128 + signal.SIGTERM, -signal.SIGINT, 128 + signal.SIGINT}


@dataclass(frozen=True)
class Replica:
    index: int
    port: int
    config: ServeConfig
    env: dict[str, str]              # extra environment (CUDA_VISIBLE_DEVICES on GPU)

    @property
    def name(self) -> str:
        return f"replica-{self.index}"


@dataclass(frozen=True)
class FleetPlan:
    config: ServeConfig
    port: int                        # the router's
    replicas: list[Replica]
    router_argv: list[str]
    local_host: str                  # how this machine reaches its own servers

    def url(self, port: int) -> str:
        return f"http://{self.local_host}:{port}"

    @property
    def worker_urls(self) -> list[str]:
        return [self.url(r.port) for r in self.replicas]

    def printable(self) -> str:
        lines = [f"router  :{self.port} ({self.config.fleet.router.policy}, metrics "
                 f":{self.config.fleet.router.metrics_port})  {' '.join(self.router_argv)}"]
        for r in self.replicas:
            where = (f"cores {r.config.server.cpu_cores} threads {r.config.server.resolved_cpu_threads()}"
                     if r.config.server.device is Device.cpu else f"GPU {r.env.get('CUDA_VISIBLE_DEVICES')}")
            lines.append(f"{r.name} :{r.port} {where}")
        return "\n".join(lines)


def _local_host(host: str) -> str:
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def _core_shares(cores: list[int], n: int) -> list[list[int]]:
    k, extra = divmod(len(cores), n)
    out, start = [], 0
    for i in range(n):
        size = k + (1 if i < extra else 0)
        out.append(cores[start:start + size])
        start += size
    return out


def plan(config: ServeConfig, *, replicas: int | None = None, port: int | None = None,
         validate_sglang_args: bool = True, download: bool = True) -> FleetPlan:
    """Each replica's config and environment, and the router's command. Raises ConfigError naming the field.
    Models given by Hugging Face id are resolved (downloaded, where `download` and the config allow) here, once:
    the replicas' configs name folders."""
    fleet = config.fleet
    n = fleet.replicas if replicas is None else replicas
    if n < 1:
        raise ConfigError("fleet.replicas: must be >= 1 (`--replicas`)")
    port = config.server.port if port is None else port
    base = fleet.replica_base_port or port + 1
    ports = list(range(base, base + n))
    if port in ports:
        raise ConfigError(f"fleet.replica_base_port: replica ports {base}-{ports[-1]} include the router's port "
                          f"{port}")
    if ports[-1] > 65535:
        raise ConfigError(f"fleet.replica_base_port: {n} replicas from {base} run past port 65535")
    if fleet.router.metrics_port in ports + [port]:
        raise ConfigError(f"fleet.router.metrics_port: {fleet.router.metrics_port} is also a router or replica "
                          f"port (router {port}, replicas {base}-{ports[-1]})")
    server = config.server
    extra_env: list[dict[str, str]]
    updates: list[dict]
    if server.device is Device.cpu:
        cores = server.cpu_cores or available_cores()
        if len(cores) < n:
            raise ConfigError(f"fleet.replicas: {n} CPU replicas need at least {n} cores, this machine gives "
                              f"{len(cores)} ({cores}); two replicas on one core make OpenMP spin")
        updates = [{"cpu_cores": share} for share in _core_shares(list(cores), n)]
        extra_env = [{} for _ in range(n)]
    else:
        gpus = fleet.gpus if fleet.gpus is not None else list(range(n))
        if len(gpus) < n:
            raise ConfigError(f"fleet.gpus: lists {len(gpus)} GPU(s) for {n} replicas (one replica per GPU)")
        updates = [{} for _ in range(n)]
        extra_env = [{"CUDA_VISIBLE_DEVICES": str(g)} for g in gpus[:n]]
    config, _ = launcher.resolve_models(config, download=download)
    out = []
    for i in range(n):
        cfg = config.model_copy(update={"server": server.model_copy(update={"port": ports[i], **updates[i]})})
        out.append(Replica(i, ports[i], cfg, extra_env[i]))
    # The replicas' own checks run in their launchers; the ones that would fail all of them fail here, once.
    launcher.plan(out[0].config, validate_sglang_args=validate_sglang_args)
    router_args.validate(config)
    local = _local_host(server.host)
    argv = router_args.build_argv(config, port=port, worker_urls=[f"http://{local}:{p}" for p in ports])
    return FleetPlan(config, port, out, argv, local)


def replica_config_dict(replica: Replica) -> dict:
    """The replica's config as YAML data (what `dflash-serve serve` loads): absolute paths, no fleet section."""
    return replica.config.model_dump(mode="json", exclude={"fleet"})


def prometheus_targets(fp: FleetPlan) -> list[dict]:
    """File-based service discovery (Prometheus `file_sd_configs`): one group per replica, labelled."""
    fleet = fp.config.fleet
    host = fleet.advertise_host or fp.config.server.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return [{"targets": [f"{host}:{r.port}"], "labels": {"replica": str(r.index)}} for r in fp.replicas]


def write_atomically(path: Path, text: str) -> None:
    # Prometheus re-reads the file when it changes: it must never see half of it.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------------ processes
_print_lock = threading.Lock()


def say(msg: str) -> None:
    with _print_lock:
        print(f"dflash-serve fleet: {msg}", file=sys.stderr, flush=True)


def _pump(stream: IO[bytes], prefix: str) -> None:
    """Copy a child's output to ours, each line prefixed with the child's name."""
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        with _print_lock:
            sys.stdout.write(f"[{prefix}] {line if line.endswith(chr(10)) else line + chr(10)}")
            sys.stdout.flush()
    stream.close()


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str]
    health_url: str | None = None
    proc: subprocess.Popen | None = None
    started: float = 0.0
    restarts: int = 0
    backoff: float = RESTART_BACKOFF[0]
    restart_at: float | None = None
    pump: threading.Thread | None = field(default=None, repr=False)

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.started = time.monotonic()
        self.restart_at = None
        self.pump = threading.Thread(target=_pump, args=(self.proc.stdout, self.name), daemon=True)
        self.pump.start()

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill_group(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def schedule_restart(self, now: float) -> float:
        if now - self.started > STABLE_SECONDS:
            self.backoff = RESTART_BACKOFF[0]
        delay = self.backoff
        self.backoff = min(self.backoff * 2, RESTART_BACKOFF[1])
        self.restart_at = now + delay
        return delay


def healthy(url: str, timeout: float = 4) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def router_healthy_workers(fp: FleetPlan, key: str | None = None) -> int:
    """How many of our replicas the router lists as healthy (its /workers; the router's own /health says only
    that the router is up, and it answers 503 `no_available_workers` until its workers are registered). With
    `key`: the router's control-plane key, which guards /workers."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{fp.url(fp.port)}/workers", headers=headers),
                                    timeout=4) as r:
            workers = json.load(r).get("workers", [])
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError, ValueError):
        return 0
    ours = set(fp.worker_urls)
    return sum(1 for w in workers if w.get("url") in ours and w.get("is_healthy"))


class Fleet:
    def __init__(self, fp: FleetPlan, run_dir: Path):
        self.plan = fp
        self.run_dir = run_dir
        self.stopping = False
        self.signalled = False
        self.replicas: list[Child] = []
        for r in fp.replicas:
            path = run_dir / f"{r.name}.yaml"
            path.write_text(yaml.safe_dump(replica_config_dict(r), sort_keys=False))
            argv = [sys.executable, "-m", "service.cli", "serve", "--config", str(path)]
            self.replicas.append(Child(r.name, argv, {**os.environ, **r.env}, f"{fp.url(r.port)}/health"))
        # The router gets the replicas' API key in their variable, and the admin key as its control-plane key
        # (service/router_entry.py); without an admin key, one only this process holds: it reads /workers.
        keys = launcher.key_env(fp.config)
        self.control_key = keys.setdefault(names.ADMIN_API_KEY, secrets.token_urlsafe(32))
        router_env = {**os.environ} | keys
        self.router = Child("router", fp.router_argv, router_env)
        self.children = [*self.replicas, self.router]

    # -- signals
    def _on_signal(self, signum, _frame) -> None:
        if not self.stopping:
            self.stopping = self.signalled = True
            say(f"got {signal.Signals(signum).name}: draining the router and {len(self.replicas)} replicas "
                f"(up to {self.plan.config.server.shutdown_grace_seconds:g}s)")
            for c in self.children:
                c.signal(signal.SIGTERM)

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    # -- phases
    def start_replicas(self) -> bool:
        self.router.start()
        for c in self.replicas:
            c.start()
        say(f"starting the router on :{self.plan.port} and {len(self.replicas)} replicas: " + ", ".join(
            f"{c.name} on :{r.port}" for c, r in zip(self.replicas, self.plan.replicas)))
        deadline = time.monotonic() + self.plan.config.fleet.startup_timeout_seconds
        waiting = list(self.replicas)
        while waiting and not self.stopping:
            for c in [self.router, *waiting]:
                rc = c.poll()
                if rc is not None:
                    say(f"{c.name} exited with status {rc} at startup (its log is above, prefixed [{c.name}]); "
                        f"stopping the fleet")
                    return False
            for c in list(waiting):
                if healthy(c.health_url):
                    say(f"{c.name} healthy after {time.monotonic() - c.started:.0f}s")
                    waiting.remove(c)
            if time.monotonic() > deadline:
                say(f"{', '.join(c.name for c in waiting)} not healthy after "
                    f"{self.plan.config.fleet.startup_timeout_seconds:g}s (fleet.startup_timeout_seconds); "
                    f"stopping the fleet")
                return False
            time.sleep(0.5)
        return not self.stopping

    def wait_router(self) -> bool:
        deadline = time.monotonic() + 120
        n = len(self.replicas)
        while not self.stopping:
            rc = self.router.poll()
            if rc is not None:
                say(f"the router exited with status {rc} at startup (its log is above, prefixed [router])")
                return False
            if router_healthy_workers(self.plan, self.control_key) == n:
                return True
            if time.monotonic() > deadline:
                say(f"the router did not list all {n} replicas as healthy within 120s")
                return False
            time.sleep(0.5)
        return False

    def write_targets(self, targets: list[dict]) -> None:
        path = self.plan.config.fleet.prometheus_targets_file
        if path is not None:
            write_atomically(path, json.dumps(targets, indent=1) + "\n")

    def watch(self) -> None:
        """Until a stop signal: restart any process that exits."""
        while not self.stopping:
            now = time.monotonic()
            for c in self.children:
                rc = c.poll()
                if rc is None or c.proc is None:
                    continue
                if c.restart_at is None:
                    delay = c.schedule_restart(now)
                    say(f"{c.name} exited with status {rc}; restarting it in {delay:g}s")
                elif now >= c.restart_at and not self.stopping:
                    c.restarts += 1
                    c.start()
                    say(f"{c.name} restarted (restart {c.restarts})")
            time.sleep(0.5)

    def stop(self) -> int:
        """SIGTERM everyone still running, wait for the drain, then kill what is left. Returns the exit status."""
        self.stopping = True
        t0 = time.monotonic()
        for c in self.children:
            c.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.plan.config.server.shutdown_grace_seconds + KILL_MARGIN_SECONDS
        while time.monotonic() < deadline and any(c.poll() is None for c in self.children):
            time.sleep(0.2)
        status = 0
        for c in self.children:
            if c.poll() is None:
                say(f"{c.name} still running after the drain; killing it")
                c.kill_group()
                c.proc.wait()
                status = launcher.KILLED_STATUS
            elif c.proc is not None and c.poll() not in STOPPED_CLEANLY:
                say(f"{c.name} stopped with status {c.poll()}")
                status = status or 1
        for c in self.children:
            if c.pump is not None:
                c.pump.join(timeout=2)
        say(f"stopped after {time.monotonic() - t0:.1f}s of drain, status {status}")
        return status


def run(fp: FleetPlan) -> int:
    host = fp.config.server.host
    launcher.check_port_free(host, fp.port)
    for r in fp.replicas:
        launcher.check_port_free(host, r.port, f"fleet.replica_base_port (replica {r.index})")
    launcher.check_port_free(host, fp.config.fleet.router.metrics_port, "fleet.router.metrics_port")
    with tempfile.TemporaryDirectory(prefix="dflash-fleet-") as run_dir:
        fleet = Fleet(fp, Path(run_dir))
        fleet.install_signal_handlers()
        say(f"replica configs in {run_dir} (removed at exit)")
        try:
            if not fleet.start_replicas() or not fleet.wait_router():
                status = fleet.stop()
                return status if fleet.signalled else 1
            # Only now: a replica still loading its model is not a replica that is down (DFlashServerDown).
            fleet.write_targets(prometheus_targets(fp))
            say(f"ready: {fp.url(fp.port)} -> {len(fp.replicas)} replicas ({', '.join(fp.worker_urls)}), router "
                f"metrics on :{fp.config.fleet.router.metrics_port}")
            fleet.watch()
            return fleet.stop()
        finally:
            fleet.write_targets([])  # a deliberately stopped fleet is not a fleet that is down
