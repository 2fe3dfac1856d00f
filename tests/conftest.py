"""Shared fixtures: the tiny model pair and real `dflash-serve serve` processes on CPU; child-process probes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from harness.server import ManagedServer

REPO = Path(__file__).resolve().parents[1]


def child_result(*args: str, cpu_layer: bool = True, **env: str):
    """Run ``python *args`` from the repository root and return the JSON its ``RESULT{json}`` stdout line carries.
    Why a child: SGLang imports on CPU only through the CPU layer's start-up stubs (``cpu_layer``: DFLASH_SERVE_CPU=1
    at interpreter start; False: neither it nor SGLANG_USE_CPU_ENGINE), and some variables (TRITON_INTERPRET) must be
    set before the first import. ``env``: more of the child's environment."""
    child_env = {k: v for k, v in os.environ.items() if k not in ("DFLASH_SERVE_CPU", "SGLANG_USE_CPU_ENGINE")}
    child_env.update(env)
    if cpu_layer:
        child_env["DFLASH_SERVE_CPU"] = "1"
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=child_env, cwd=REPO, timeout=300)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT")), None)
    assert line, f"probe failed:\n{r.stderr[-3000:]}"
    return json.loads(line[len("RESULT"):])


BUNDLED = REPO / "models" / "tiny-code"


@pytest.fixture(scope="session")
def random_pair(tmp_path_factory) -> dict[str, Path]:
    """The deterministic random pair (models/tiny-random if the installer made it, else built now)."""
    ready = REPO / "models" / "tiny-random"
    if (ready / "drafter" / "model.safetensors").is_file():
        return {"target": ready / "target", "drafter": ready / "drafter"}
    from dflash_models import tiny

    return tiny.build(tmp_path_factory.mktemp("tiny"), log=lambda *_: None)


@pytest.fixture(scope="session")
def tiny_pair(request) -> dict[str, Path]:
    """The pair the servers under test run: the bundled trained pair (models/tiny-code, what the
    default config serves), or the random pair if a checkout lacks it."""
    if (BUNDLED / "drafter" / "model.safetensors").is_file():
        return {"target": BUNDLED / "target", "drafter": BUNDLED / "drafter"}
    return request.getfixturevalue("random_pair")


def default_config(pair: dict[str, Path], **speculative) -> dict:
    """deploy/configs/cpu.yaml -- the embedded default users run -- pointed at `pair`."""
    cfg = yaml.safe_load((REPO / "deploy/configs/cpu.yaml").read_text())
    cfg["model"] |= {"path": str(pair["target"]), "served_name": "tiny"}
    if speculative:
        cfg["speculative"] = {k: str(v) if isinstance(v, Path) else v for k, v in speculative.items()}
    else:
        cfg["speculative"]["draft_model_path"] = str(pair["drafter"])
    return cfg


def _servers(tmp_path_factory, dirname: str):
    started: list[ManagedServer] = []
    workdir = tmp_path_factory.mktemp(dirname)

    def make(config: dict, name: str, env: dict[str, str] | None = None) -> ManagedServer:
        s = ManagedServer(config, workdir, name, env=env).start()
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def server_factory(tmp_path_factory):
    """Servers that live until the session ends (the shared plain / dflash / adaptive servers)."""
    yield from _servers(tmp_path_factory, "servers")


@pytest.fixture(scope="module")
def module_server_factory(tmp_path_factory):
    """Servers stopped when the test module ends: a server costs ~3 GB, and CI runs out of memory (the kernel
    kills a scheduler) if every module's servers live to the end of the session."""
    yield from _servers(tmp_path_factory, "module-servers")


@pytest.fixture(scope="session")
def plain_server(server_factory, tiny_pair) -> ManagedServer:
    return server_factory(default_config(tiny_pair, algorithm="none"), "plain")


@pytest.fixture(scope="session")
def dflash_server(server_factory, tiny_pair) -> ManagedServer:
    """Upstream's DFLASH at the drafter's block (a config choice; the default serves dflash_adaptive)."""
    return server_factory(default_config(tiny_pair, algorithm="dflash", draft_model_path=tiny_pair["drafter"]),
                          "dflash")


@pytest.fixture(scope="session")
def adaptive_server(server_factory, tiny_pair) -> ManagedServer:
    """The plugin-registered DFLASH_ADAPTIVE algorithm."""
    return server_factory(default_config(tiny_pair, algorithm="dflash_adaptive", draft_model_path=tiny_pair["drafter"]),
                          "adaptive")


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
