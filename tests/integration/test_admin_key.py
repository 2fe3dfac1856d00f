"""The client key is not an admin key: SGLang's admin routes answer only to `server.admin_api_key_env`'s
key, no GET route hands out a key or a command line holding one, and authentication comes before any look at the
body. Two real servers: one with a client key only (admin routes closed to everyone), one with both keys.

The routes under test are SGLang's own route table (the FastAPI app's routes and their `@auth_level`), read in a
child process that imports SGLang's HTTP server as the served one does.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from harness.server import ManagedServer
from loadtest import faults
from tests.conftest import REPO, default_config

pytestmark = pytest.mark.server

KEY, KEY_ENV = "client-key-5b2e90d1", "DFLASH_ADMIN_TEST_KEY"
ADMIN, ADMIN_ENV = "admin-key-c47a13f8", "DFLASH_ADMIN_TEST_ADMIN_KEY"
CLIENT = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"}
MODEL = "tiny"
MARKER = "zq-admin-canary-31f7"  # in a prompt sent after /configure_logging was tried: must stay out of the log

_ROUTE_TABLE = """
import json
from service.launcher import activate_cpu_layer_here
activate_cpu_layer_here()
from sglang.srt.entrypoints.http_server import app
from sglang.srt.utils.auth import AuthLevel
rows = []
for route in app.routes:
    methods = sorted(getattr(route, "methods", None) or ())
    if methods:
        level = getattr(getattr(route, "endpoint", None), "_auth_level", AuthLevel.NORMAL)
        rows.append({"path": route.path, "methods": methods, "admin": level != AuthLevel.NORMAL})
print(json.dumps(rows))
"""


@pytest.fixture(scope="module")
def routes() -> list[dict]:
    out = subprocess.run([sys.executable, "-c", _ROUTE_TABLE], capture_output=True, text=True, cwd=REPO,
                         timeout=300, check=True).stdout
    rows = json.loads(out.strip().splitlines()[-1])
    for r in rows:
        r["url_path"] = re.sub(r"\{[^}]+\}", "x", r["path"])
    admin = {r["path"] for r in rows if r["admin"]}
    assert {"/configure_logging", "/flush_cache", "/abort_request", "/pause_generation", "/update_weights_from_disk",
            "/release_memory_occupation", "/load_lora_adapter", "/start_profile"} <= admin, sorted(admin)
    return rows


def _serve(tiny_pair, tmp_path_factory, name: str, admin: bool, **speculative) -> ManagedServer:
    cfg = default_config(tiny_pair, **speculative)
    cfg["model"]["served_name"] = MODEL
    cfg["server"]["api_key_env"] = KEY_ENV
    env = {KEY_ENV: KEY}
    if admin:  # and the routes that can stop the scheduler opened to it: the crash-dump test uses one
        cfg["server"] |= {"admin_api_key_env": ADMIN_ENV, "scheduler_stopping_routes": True}
        env[ADMIN_ENV] = ADMIN
    return ManagedServer(cfg, tmp_path_factory.mktemp(name), name, env=env)


@pytest.fixture(scope="module")
def client_only(tiny_pair, tmp_path_factory):
    """server.api_key_env only: as the issue found it (the adaptive CPU default)."""
    with _serve(tiny_pair, tmp_path_factory, "client-only", False, algorithm="dflash_adaptive",
                draft_model_path=tiny_pair["drafter"]) as s:
        yield s


@pytest.fixture(scope="module")
def both_keys(tiny_pair, tmp_path_factory):
    with _serve(tiny_pair, tmp_path_factory, "both-keys", True, algorithm="none") as s:
        yield s


def _body(method: str) -> bytes | None:
    # not a JSON object: whatever passes authentication is then refused before any handler runs
    return b"[]" if method in ("POST", "PUT", "PATCH", "DELETE") else None


def _refusals(server: ManagedServer, routes: list[dict], headers: dict, expected: int) -> list[str]:
    bad = []
    for r in (r for r in routes if r["admin"]):
        for method in r["methods"]:
            if method == "HEAD":
                continue
            status, body = faults.send(server.url, method, r["url_path"], _body(method), headers, timeout=60)
            problem = faults.error_shape_problem(status, body) if status == expected else None
            if status != expected or problem:
                bad.append(f"{method} {r['path']}: {status} {body[:160]!r} {problem or ''}")
    return bad


def test_admin_routes_refuse_the_client_key_when_no_admin_key_is_configured(client_only, routes):
    bad = _refusals(client_only, routes, CLIENT, 403)
    assert not bad, "\n".join(bad)


def test_admin_routes_refuse_the_client_key_and_unauthenticated_callers(both_keys, routes):
    bad = _refusals(both_keys, routes, CLIENT, 403)
    bad += _refusals(both_keys, routes, {"Content-Type": "application/json"}, 401)
    assert not bad, "\n".join(bad)


def test_admin_routes_accept_the_admin_key(both_keys, routes):
    """Every admin route lets the admin key through (a body that is not a JSON object stops it before any handler
    runs; GET-only routes are reads); then one admin action for real."""
    refused = []
    for r in (r for r in routes if r["admin"]):
        method = next((m for m in ("POST", "PUT") if m in r["methods"]), "GET" if r["methods"] == ["GET", "HEAD"]
                      or r["methods"] == ["GET"] else None)
        if method is None:  # DELETE only: an action without a body to stop it
            continue
        status, body = faults.send(both_keys.url, method, r["url_path"], _body(method), ADMIN_AUTH, timeout=60)
        if status in (401, 403):
            refused.append(f"{method} {r['path']}: {status} {body[:160]!r}")
    assert not refused, "\n".join(refused)
    assert faults.send(both_keys.url, "POST", "/flush_cache", None, ADMIN_AUTH)[0] == 200


@pytest.mark.parametrize("which", ["client_only", "both_keys"])
def test_no_get_route_returns_a_key_or_a_command_line_holding_one(which, routes, request):
    """Every GET route of the table with the client key; the GET-only ones (reads) with the admin key too."""
    server: ManagedServer = request.getfixturevalue(which)
    leaks, answered = [], set()
    for r in (r for r in routes if "GET" in r["methods"]):
        for headers in (CLIENT, ADMIN_AUTH):
            if headers is ADMIN_AUTH and set(r["methods"]) - {"GET", "HEAD"}:
                continue  # GET on an action route would run it (release memory, start the profiler, ...)
            status, body = faults.send(server.url, "GET", r["url_path"], None, headers, timeout=60)
            answered |= {r["path"]} if status == 200 else set()
            leaks += [f"GET {r['path']} ({status}): holds the {name} key" for name, key in
                      (("client", KEY), ("admin", ADMIN)) if key.encode() in body]
    assert {"/server_info", "/get_server_info"} <= answered
    assert not leaks, "\n".join(leaks)
    info = json.loads(faults.send(server.url, "GET", "/server_info", None, CLIENT)[1])
    # The made-up admin key of a server without one is no more shown than a configured one.
    assert info["api_key"] == info["admin_api_key"] == "***"
    assert not re.search(r"--(admin-)?api-key (?!\*\*\*)", info["launch_command"]), info["launch_command"]


def test_authentication_comes_before_the_model_check(client_only):
    """An unauthenticated request with a wrong model name learns nothing (401), not the served model's name."""
    body = json.dumps(faults.chat_body("not-the-model", "hello", 4, stream=False)).encode()
    for headers in ({"Content-Type": "application/json"}, {**CLIENT, "Authorization": "Bearer wrong"}):
        status, answer = faults.send(client_only.url, "POST", "/v1/chat/completions", body, headers)
        assert status == 401 and MODEL.encode() not in answer, (status, answer)
    status, answer = faults.send(client_only.url, "POST", "/v1/chat/completions", body, CLIENT)
    assert status == 404 and f"`{MODEL}`".encode() in answer  # with the key: told what is served


def test_configure_logging_with_the_client_key_is_refused_and_prompts_stay_out_of_the_log(client_only):
    status, answer = faults.send(client_only.url, "POST", "/configure_logging",
                                 json.dumps({"log_requests": True, "log_requests_level": 3}).encode(), CLIENT)
    assert status == 403, answer
    status, answer = faults.send(client_only.url, "POST", "/v1/chat/completions", json.dumps(
        faults.chat_body(MODEL, f"{MARKER} import os", 8, stream=False)).encode(), CLIENT)
    assert status == 200, answer
    log = client_only.log_path.read_text(errors="replace")
    assert MARKER not in log
    assert KEY not in log


def test_no_key_in_the_log_or_on_a_command_line(both_keys):
    log = both_keys.log_path.read_text(errors="replace")
    assert KEY not in log and ADMIN not in log
    cmdlines = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert KEY not in cmdlines and ADMIN not in cmdlines


def test_a_crash_dump_holds_no_key(both_keys, tmp_path):
    """An admin may have the server dump its requests when it crashes (`crash_dump_folder`); the dump pickles the
    server arguments, the resolved config and the command line. Crashes the server: the module's last test."""
    folder = tmp_path / "dumps"
    status, _ = faults.send(both_keys.url, "POST", "/configure_logging",
                            json.dumps({"crash_dump_folder": str(folder)}).encode(), ADMIN_AUTH)
    assert status == 200
    status, _ = faults.send(both_keys.url, "POST", "/v1/completions", json.dumps(
        {"model": MODEL, "prompt": "import os", "max_tokens": 2}).encode(), CLIENT)
    assert status == 200
    try:  # SGLang's expert-distribution recorder raises in the scheduler of a model without experts (opened to the
        # admin key by server.scheduler_stopping_routes: closed, the route answers 403 and nothing crashes)
        faults.send(both_keys.url, "POST", "/start_expert_distribution_record", None, ADMIN_AUTH, timeout=30)
    except (ConnectionError, OSError):
        pass
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list(folder.rglob("*.pkl")):
        time.sleep(1)
    dumps = list(folder.rglob("*.pkl"))
    assert dumps, "no crash dump written"
    for dump in dumps:
        data = dump.read_bytes()
        assert KEY.encode() not in data and ADMIN.encode() not in data, dump
