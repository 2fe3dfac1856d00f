"""Start and stop a real `dflash-serve serve` process (tests, benchmarks, load tests, training data regeneration)."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import fcntl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def http_json(url: str, body: dict | None = None, headers: dict | None = None, timeout: float = 120):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def terminate(proc: subprocess.Popen | None, timeout: float) -> int | None:
    """SIGTERM (the launcher then drains), SIGKILL after `timeout`; the exit status, None if never started."""
    if proc is None:
        return None
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@contextlib.contextmanager
def side_by_side(servers: dict[str, "ManagedServer"]):
    """Spawn every server, wait for each, yield them; stop all at exit (start-ups overlap: one wait, not n)."""
    try:
        with starting(len(servers)):
            for s in servers.values():
                s.spawn()
            for s in servers.values():
                s.wait_ready()
        yield servers
    finally:
        for s in servers.values():
            s.stop()


# What one server of the bundled tiny pair holds on CPU (its scheduler with the KV pools of the embedded default,
# its HTTP and detokenizer processes, the launcher: ~2.2 GB unshared), with room to spare; other models set their own.
SERVER_BYTES = int(float(os.environ.get("DFLASH_HARNESS_SERVER_GIB", "2.5")) * (1 << 30))
ROOM_WAIT_SECONDS = 600.0
_START_LOCK = Path(tempfile.gettempdir()) / "dflash-serve-harness-start.lock"
_held = 0  # this process's depth inside starting()


@contextlib.contextmanager
def starting(count: int = 1):
    """Start servers one group at a time on this machine, each group once there is memory for it.

    Why: `pytest -n 2` runs two test files at once, each with its servers (and the session's shared ones); a server
    started once the others have taken the memory is refused by SGLang ("no memory for the KV cache") or killed by
    the kernel. A group starts under a machine-wide lock once `count` x SERVER_BYTES are available; while there is
    not enough, it waits without the lock (the other file's smaller group may start, and its servers stop at its
    end), up to ROOM_WAIT_SECONDS, then goes ahead as it would have.
    """
    import psutil

    global _held
    if _held:  # a start inside a start of this process: the outer one holds the lock and waited
        _held += 1
        try:
            yield
        finally:
            _held -= 1
        return
    need, deadline, said = count * SERVER_BYTES, time.monotonic() + ROOM_WAIT_SECONDS, False
    with open(_START_LOCK, "a") as lock:
        while True:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if psutil.virtual_memory().available >= need or time.monotonic() >= deadline:
                break
            fcntl.flock(lock, fcntl.LOCK_UN)
            if not said:
                print(f"[harness] waiting for {need / (1 << 30):.1f} GiB of memory to start {count} server(s)",
                      file=sys.stderr, flush=True)
                said = True
            time.sleep(2)
        _held = 1
        try:
            yield
        finally:
            _held = 0
            fcntl.flock(lock, fcntl.LOCK_UN)


BIND_FAILED = "error while attempting to bind on address"  # uvicorn's line when the port was taken meanwhile


class ManagedServer:
    """`dflash-serve serve` for `config` (a dict, as in the YAML) on a free loopback port."""

    def __init__(self, config: dict, workdir: Path, name: str, startup_timeout: float | None = None,
                 env: dict[str, str] | None = None, host: str | None = "127.0.0.1", cwd: Path | None = None):
        """`env`: extra environment for the server (e.g. its API key variable). `host=None` keeps the config's
        `server.host` (the schema's default when it has none); the URL is always loopback. `cwd`: the directory the
        server starts in; `python -m` puts it first on sys.path, ahead of PYTHONPATH, so a server run from another
        checkout starts there (its launcher and its worker from the same code)."""
        self._config, self._host = config, host
        workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = workdir / f"{name}.yaml"
        self.log_path = workdir / f"{name}.log"
        self._use_port(free_port())
        self.startup_timeout = startup_timeout or float(os.environ.get("DFLASH_STARTUP_TIMEOUT", "300"))
        self.proc: subprocess.Popen | None = None
        self.env = env
        self.cwd = cwd

    def _use_port(self, port: int) -> None:
        self.port = port
        server = {**self._config.get("server", {}), "port": port}
        if self._host is not None:
            server["host"] = self._host
        config = {**self._config, "server": server}
        self.config_path.write_text(yaml.safe_dump(json.loads(json.dumps(config, default=str))))
        self.url = f"http://127.0.0.1:{port}"

    def start(self) -> "ManagedServer":
        with starting():
            return self.spawn().wait_ready()

    def spawn(self) -> "ManagedServer":
        """Start the process without waiting for it (`wait_ready()` waits)."""
        log = self.log_path.open("w")
        env = None if self.env is None else {**os.environ, **self.env}
        self.proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "-c", str(self.config_path)],
                                     stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.cwd)
        return self

    def wait_ready(self) -> "ManagedServer":
        """Poll /health until it answers 200 (SGLang: after its warm-up generate succeeded)."""
        assert self.proc is not None, "spawn() first"
        deadline = time.monotonic() + self.startup_timeout
        retried = False
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            if not retried and BIND_FAILED in self.log_path.read_text(errors="replace"):
                # free_port() found the port free, but another starting server's own ports (SGLang opens several)
                # took it before this one bound it: its HTTP server failed while the rest stays up. Once, anew.
                retried = True
                terminate(self.proc, 60)
                self._use_port(free_port())
                self.spawn()
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not healthy after {self.startup_timeout:.0f}s:\n{self.log_tail()}")

    def __enter__(self) -> "ManagedServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self, n: int = 60) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(line for line in lines[-n:] if "server_args=" not in line)

    def stop(self, timeout: float = 60) -> int | None:
        return terminate(self.proc, timeout)

    def generate(self, input_ids, **sampling):
        body = {"input_ids": input_ids, "sampling_params": {"ignore_eos": True, **sampling}}
        return http_json(f"{self.url}/generate", body, timeout=900)

    def generate_text(self, text, **sampling):
        body = {"text": text, "sampling_params": {"ignore_eos": True, **sampling}}
        return http_json(f"{self.url}/generate", body, timeout=900)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as r:
            return r.read().decode()


class ManagedFleet:
    """`dflash-serve fleet` for `config` (a dict, as in the YAML) on free loopback ports: the router, its metrics
    port and `replicas` replica ports; the replicas' Prometheus targets file in `workdir`."""

    def __init__(self, config: dict, workdir: Path, name: str, replicas: int = 2, startup_timeout: float = 600,
                 env: dict[str, str] | None = None, argv: list[str] | None = None):
        """`argv`: the fleet command's arguments after the program (default: `fleet --config <file>
        --replicas N`); `--config` is replaced by this fleet's config file."""
        ports = _free_port_run(replicas + 2)
        self.port, self.metrics_port, self.replica_ports = ports[0], ports[1], ports[2:]
        fleet = {**config.get("fleet", {}), "replica_base_port": self.replica_ports[0],
                 "prometheus_targets_file": str(workdir / f"{name}-targets.json"),
                 "router": {**config.get("fleet", {}).get("router", {}), "metrics_port": self.metrics_port}}
        fleet.pop("advertise_host", None)
        config = {**config, "server": {**config.get("server", {}), "port": self.port, "host": "127.0.0.1"},
                  "fleet": fleet}
        workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = workdir / f"{name}.yaml"
        self.config_path.write_text(yaml.safe_dump(json.loads(json.dumps(config, default=str))))
        self.targets_file = Path(fleet["prometheus_targets_file"])
        self.log_path = workdir / f"{name}.log"
        self.url = f"http://127.0.0.1:{self.port}"
        self.replica_urls = [f"http://127.0.0.1:{p}" for p in self.replica_ports]
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.startup_timeout = startup_timeout
        argv = list(argv or ["fleet", "--config", "_", "--replicas", str(replicas)])
        argv[argv.index("--config") + 1] = str(self.config_path)
        self.argv = [sys.executable, "-m", "service.cli", *argv]
        self.env = env
        def key(field: str) -> str | None:
            name = config["server"].get(field)
            return ((env or {}).get(name) or os.environ.get(name)) if name else None

        self.api_key = key("api_key_env")
        self.headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        admin_key = key("admin_api_key_env")  # the router's control plane (/workers) takes only the admin key
        self.admin_headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ManagedFleet":
        with starting(len(self.replica_urls)):
            return self._start()

    def _start(self) -> "ManagedFleet":
        log = self.log_path.open("w")
        env = None if self.env is None else {**os.environ, **self.env}
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fleet exited with {self.proc.returncode}:\n{self.log_tail()}")
            if "dflash-serve fleet: ready:" in self.log_path.read_text(errors="replace"):
                return self
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"fleet not ready after {self.startup_timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 80) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(line for line in lines[-n:] if "server_args=" not in line)

    def fleet_lines(self) -> list[str]:
        """The fleet's own messages (not its children's output)."""
        return [line for line in self.log_path.read_text(errors="replace").splitlines()
                if line.startswith("dflash-serve fleet: ")]

    def workers(self) -> dict[str, bool]:
        """The router's view: replica URL -> healthy (needs the config's admin key)."""
        workers = http_json(f"{self.url}/workers", headers=self.admin_headers, timeout=10)["workers"]
        return {w["url"]: w["is_healthy"] for w in workers}

    def stop(self, timeout: float = 120) -> int | None:
        return terminate(self.proc, timeout)

    def __enter__(self) -> "ManagedFleet":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _free_port_run(n: int, host: str = "127.0.0.1") -> list[int]:
    """n consecutive free ports (a fleet's replicas listen on base + i), below the kernel's ephemeral range:
    a fleet's processes bind ports for their own plumbing (ZMQ, the router's) from that range while the
    replicas start, and could take a replica's port before the replica binds it."""
    import random

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(200):
        base = random.randint(10000, max(10001, low - n - 1))
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind((host, p))
            return list(range(base, base + n))
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free ports below {low}")
