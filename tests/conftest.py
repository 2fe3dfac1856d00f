"""Shared fixtures: the tiny model pair and real `dflash-serve serve` processes on CPU."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from harness.server import ManagedServer

REPO = Path(__file__).resolve().parents[1]


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
    return server_factory(default_config(tiny_pair), "dflash")


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
