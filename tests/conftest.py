"""Shared fixtures: the tiny model pair and real `dflash-serve serve` processes on CPU."""
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

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = float(os.environ.get("DFLASH_TEST_STARTUP_TIMEOUT", "300"))


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> dict[str, Path]:
    """The deterministic tiny pair (models/tiny-random if the installer made it, else built now)."""
    ready = REPO / "models" / "tiny-random"
    if (ready / "drafter" / "model.safetensors").is_file():
        return {"target": ready / "target", "drafter": ready / "drafter"}
    from dflash_models import tiny

    return tiny.build(tmp_path_factory.mktemp("tiny"), log=lambda *_: None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, body: dict | None = None, headers: dict | None = None, timeout: float = 120) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


class Server:
    """A real server started through the product's launcher (`dflash-serve serve`)."""

    def __init__(self, config: dict, workdir: Path, name: str):
        self.port = free_port()
        config = {**config, "server": {**config.get("server", {}), "port": self.port}}
        self.config_path = workdir / f"{name}.yaml"
        self.config_path.write_text(yaml.safe_dump(json.loads(json.dumps(config, default=str))))
        self.log_path = workdir / f"{name}.log"
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Server":
        log = self.log_path.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "-c", str(self.config_path)],
                                     stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(l for l in lines[-n:] if "server_args=" not in l)

    def stop(self, timeout: float = 60) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.terminate()
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def generate(self, input_ids, **sampling) -> dict | list:
        body = {"input_ids": input_ids, "sampling_params": {"ignore_eos": True, **sampling}}
        return http_json(f"{self.url}/generate", body, timeout=600)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as r:
            return r.read().decode()


def base_config(pair: dict[str, Path], **speculative) -> dict:
    return {
        "model": {"path": str(pair["target"]), "dtype": "float32", "served_name": "tiny"},
        "server": {"device": "cpu", "max_total_tokens": 32768, "max_running_requests": 64},
        "speculative": speculative or {"algorithm": "none"},
    }


@pytest.fixture(scope="session")
def server_factory(tmp_path_factory):
    started: list[Server] = []
    workdir = tmp_path_factory.mktemp("servers")

    def make(config: dict, name: str) -> Server:
        s = Server(config, workdir, name).start()
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def plain_server(server_factory, tiny_pair) -> Server:
    return server_factory(base_config(tiny_pair), "plain")


@pytest.fixture(scope="session")
def dflash_server(server_factory, tiny_pair) -> Server:
    return server_factory(base_config(tiny_pair, algorithm="dflash", draft_model_path=str(tiny_pair["drafter"])),
                          "dflash")


@pytest.fixture(scope="session")
def tokenizer(tiny_pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_pair["target"]))


PROMPTS = [
    "import os\nimport sys\n\ndef main():\n",
    "for i in range(10):\n    print(i)\n",
    "class Foo:\n    def __init__(self):\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "x = [1, 2, 3]\ny = {k: v for k, v in",
    "def fib(n):\n    if n < 2:\n        return n\n",
]
