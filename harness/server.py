"""Start and stop a real `dflash-serve serve` process (tests, benchmarks, load tests, training data regeneration)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
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


class ManagedServer:
    """`dflash-serve serve` for `config` (a dict, as in the YAML) on a free loopback port."""

    def __init__(self, config: dict, workdir: Path, name: str, startup_timeout: float | None = None,
                 env: dict[str, str] | None = None, host: str | None = "127.0.0.1"):
        """`env`: extra environment for the server (e.g. its API key variable). `host=None` keeps the config's
        `server.host` (the schema's default when it has none); the URL is always loopback."""
        self.port = free_port()
        server = {**config.get("server", {}), "port": self.port}
        if host is not None:
            server["host"] = host
        config = {**config, "server": server}
        workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = workdir / f"{name}.yaml"
        self.config_path.write_text(yaml.safe_dump(json.loads(json.dumps(config, default=str))))
        self.log_path = workdir / f"{name}.log"
        self.url = f"http://127.0.0.1:{self.port}"
        self.startup_timeout = startup_timeout or float(os.environ.get("DFLASH_STARTUP_TIMEOUT", "300"))
        self.proc: subprocess.Popen | None = None
        self.env = env

    def start(self) -> "ManagedServer":
        return self.spawn().wait_ready()

    def spawn(self) -> "ManagedServer":
        """Start the process without waiting for it (`wait_ready()` waits)."""
        log = self.log_path.open("w")
        env = None if self.env is None else {**os.environ, **self.env}
        self.proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "-c", str(self.config_path)],
                                     stdout=log, stderr=subprocess.STDOUT, env=env)
        return self

    def wait_ready(self) -> "ManagedServer":
        """Poll /health until it answers 200 (SGLang: after its warm-up generate succeeded)."""
        assert self.proc is not None, "spawn() first"
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
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
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def generate(self, input_ids, **sampling):
        body = {"input_ids": input_ids, "sampling_params": {"ignore_eos": True, **sampling}}
        return http_json(f"{self.url}/generate", body, timeout=900)

    def generate_text(self, text, **sampling):
        body = {"text": text, "sampling_params": {"ignore_eos": True, **sampling}}
        return http_json(f"{self.url}/generate", body, timeout=900)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as r:
            return r.read().decode()
