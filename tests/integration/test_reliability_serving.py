"""Reliability and security of the real server, against the adaptive configuration with an API key:
clients that vanish mid-stream, malformed requests, a property-based run against the OpenAPI document, the
routes the key protects, and what the log must not contain. One server for the module (start-up is most of the
cost on CPU); the tests run in file order and the log check comes last.

Bounded for CI; the long versions are `python -m loadtest.soak` and the environment variables
DFLASH_RELIABILITY_DISCONNECTS (default 40; a full run is 200), DFLASH_RELIABILITY_FUZZ_EXAMPLES
(default 20 per operation and mode, the generation endpoints) and DFLASH_RELIABILITY_ROUTE_EXAMPLES (default 2
per operation, every operation of the OpenAPI document, each sent with no key, the client key and the admin key).
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import time

import httpx
import pytest

from loadtest import faults, server_metrics
from harness.server import ManagedServer
from tests.conftest import default_config

pytestmark = pytest.mark.server

KEY = "reliability-key-3c9e1f0b"
KEY_ENV = "DFLASH_RELIABILITY_API_KEY"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADMIN_KEY = "reliability-admin-5e0d27aa"
ADMIN_ENV = "DFLASH_RELIABILITY_ADMIN_KEY"
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
MODEL = "tiny"
CONTEXT = 512          # short context: a request without max_tokens reaches it in seconds on CPU
MARKER = "zq-canary-7d41b9"  # in prompts only: must never appear in the server log
N_DISCONNECTS = int(os.environ.get("DFLASH_RELIABILITY_DISCONNECTS", "40"))
FUZZ_EXAMPLES = int(os.environ.get("DFLASH_RELIABILITY_FUZZ_EXAMPLES", "20"))
ROUTE_EXAMPLES = int(os.environ.get("DFLASH_RELIABILITY_ROUTE_EXAMPLES", "2"))
OPEN_PATHS = ("/health", "/health_generate", "/ready", "/metrics")  # documented: no key (docs/SECURITY.md)


@pytest.fixture(scope="module")
def server(tiny_pair, tmp_path_factory) -> ManagedServer:
    cfg = default_config(tiny_pair, algorithm="dflash_adaptive", draft_model_path=tiny_pair["drafter"])
    cfg["model"] |= {"served_name": MODEL, "context_length": CONTEXT}
    cfg["server"] |= {"api_key_env": KEY_ENV, "admin_api_key_env": ADMIN_ENV}
    with ManagedServer(cfg, tmp_path_factory.mktemp("reliability"), "reliability",
                       env={KEY_ENV: KEY, ADMIN_ENV: ADMIN_KEY}) as s:
        yield s


def completes(server: ManagedServer, max_tokens: int = 2) -> bool:
    status, body = faults.send(server.url, "POST", "/v1/completions",
                               json.dumps({"model": MODEL, "prompt": "def add(a, b):", "max_tokens": max_tokens,
                                           "temperature": 0}).encode(),
                               {**AUTH, "Content-Type": "application/json"})
    return status == 200 and json.loads(body)["usage"]["completion_tokens"] == max_tokens


def counter(server: ManagedServer, name: str) -> float:
    return server_metrics.total(server_metrics.scrape(server.url), name) or 0.0


def active_chat_handlers(server: ManagedServer) -> float:
    for labels, value in (server_metrics.scrape(server.url) or {}).get("sglang:http_requests_active", []):
        if labels.get("endpoint") == "/v1/chat/completions" and labels.get("method") == "POST":
            return value
    return 0.0


# ---------------------------------------------------------------------------------------------- disconnects


def test_clients_that_disconnect_mid_stream_leave_nothing_behind(server):
    """N streaming requests that would each decode ~480 tokens; every client closes its socket 0.5 s after its first
    chunk. Within 5 s: a new request is answered, nothing runs or waits, no KV cache is held (scheduler's live view
    and the exported gauges), and no request keeps decoding (the generated-token counter stops)."""
    assert faults.wait_idle(server.url, AUTH, timeout=30)[0], "server not idle before the test"
    tokens_before = counter(server, "sglang:generation_tokens_total")
    body = {**faults.chat_body(MODEL, f"{MARKER} count to a thousand", CONTEXT - 40), "ignore_eos": True}

    async def burst():
        return await asyncio.gather(*(
            faults.stream_and_drop(f"{server.url}/v1/chat/completions", body, AUTH, drop_after=0.5,
                                   wait_first_chunk=60) for _ in range(N_DISCONNECTS)))

    dropped = asyncio.run(burst())
    t_drop = time.monotonic()
    assert all(d.status == 200 for d in dropped), [d.status for d in dropped]
    streaming = sum(d.streaming for d in dropped)
    assert streaming >= 0.9 * N_DISCONNECTS, f"only {streaming}/{N_DISCONNECTS} were decoding when dropped"

    assert completes(server), "no answer to a new request after the disconnects"
    answered = time.monotonic() - t_drop
    idle, _, state = faults.wait_idle(server.url, AUTH, timeout=max(0.0, 5 - (time.monotonic() - t_drop)))
    assert answered <= 5, f"a new request took {answered:.1f}s to be answered"
    assert idle, f"not idle 5 s after {N_DISCONNECTS} disconnects: {state}"
    deadline = t_drop + 5
    while active_chat_handlers(server) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert active_chat_handlers(server) == 0, "chat request handlers still running 5 s after the disconnects"

    generated = counter(server, "sglang:generation_tokens_total")
    time.sleep(2)
    assert counter(server, "sglang:generation_tokens_total") == generated, "something is still decoding"
    produced = generated - tokens_before - 2  # minus the check request
    assert produced < 0.5 * N_DISCONNECTS * (CONTEXT - 40), \
        f"{produced:.0f} tokens generated: dropped requests ran on instead of being aborted"


def test_a_request_without_max_tokens_decodes_to_the_context_limit_and_the_server_survives(server):
    """OpenAI's default (no max_tokens) on a model that does not stop: DFlash reserves 2 x block KV slots past the
    committed length; SGLang's req_to_token rows were 4 + block wider than the context, so the scheduler died at
    the context limit (sglang_ext/patches/dflash_headroom.py)."""
    status, raw = faults.send(server.url, "POST", "/v1/chat/completions", json.dumps({
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}).encode(),
        {**AUTH, "Content-Type": "application/json"}, timeout=600)
    assert status == 200, raw[:300]
    out = json.loads(raw)
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["total_tokens"] >= CONTEXT - 4
    assert completes(server)


# ---------------------------------------------------------------------------------------------- bad input

BAD = faults.bad_requests(MODEL, CONTEXT)


@pytest.mark.parametrize("bad", BAD, ids=[b.name for b in BAD])
def test_bad_input_gets_an_openai_error_and_the_server_keeps_serving(server, bad):
    status, body = faults.send_bad(server.url, bad, AUTH)
    assert status in bad.expect, (status, body[:300])
    assert faults.error_shape_problem(status, body) is None, faults.error_shape_problem(status, body)
    assert completes(server)


def test_oversized_bodies_are_refused_before_they_are_read(server):
    limit = 2 * 1024 * 1024  # server.max_request_bytes default
    big = faults.oversized_body(MODEL, limit + 1024)
    headers = {**AUTH, "Content-Type": "application/json"}
    with httpx.Client(timeout=60) as client:
        declared = client.post(f"{server.url}/v1/chat/completions", content=big, headers=headers)

        def chunks():
            for i in range(0, len(big), 65536):
                yield big[i:i + 65536]

        chunked = client.post(f"{server.url}/v1/chat/completions", content=chunks(), headers=headers)
    for r in (declared, chunked):
        assert r.status_code == 413, r.text[:300]
        assert faults.error_shape_problem(413, r.content) is None
    assert completes(server)


def test_property_based_run_against_the_openapi_document_finds_no_5xx(server):
    """Schemathesis generates requests from SGLang's own OpenAPI document for the OpenAI and native generation
    endpoints: schema-valid ones, and the same with one field replaced by junk, dropped or added. No response
    may be a 5xx and the server must be alive afterwards. (It found: out-of-vocabulary prompt ids killing the
    scheduler, a request without max_tokens killing it at the context limit, and several 500s on malformed input.)
    Schemathesis' own negative mode is not used: on SGLang's request schemas it needs minutes per example."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import strategies as st

    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json", headers=AUTH)
    surface = r"^/(v1/(chat/completions|completions|models.*|tokenize|detokenize|embeddings)|generate)$"
    ops = [r.ok() for r in schema.include(path_regex=surface).get_all_operations()]
    assert len(ops) >= 8, [op.label for op in ops]
    junk = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**63),
                     st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=16),
                     st.lists(st.integers(-10, 10**6), max_size=4),
                     st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
    failures: list[str] = []
    for op in ops:
        for mutate in (False, True):
            _fuzz(server, op, mutate, junk, failures)
            assert server.proc.poll() is None, f"server died during {op.label}:\n{server.log_tail()}"
    assert not failures, f"{len(failures)} server errors:\n" + "\n".join(failures[:10])
    assert completes(server)


def _fuzz(server, op, mutate: bool, junk, failures: list[str]) -> None:
    """FUZZ_EXAMPLES schema-valid requests for `op` (mutated: one field replaced by junk, dropped or added)."""
    from hypothesis import HealthCheck, Phase, given, settings, strategies as st

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    @given(case=op.as_strategy(), data=st.data())
    def run(case, data):
        body = case.body
        if isinstance(body, dict):
            _bound_generation(body, op.path)
            if mutate and body:
                key = data.draw(st.sampled_from(sorted(body)))
                how = data.draw(st.sampled_from(["junk", "drop", "extra"]))
                if how == "junk":
                    body[key] = data.draw(junk)
                elif how == "drop":
                    del body[key]
                else:
                    body[data.draw(st.text(min_size=1, max_size=8))] = data.draw(junk)
        r = case.call(base_url=server.url, headers=AUTH, timeout=300)
        if r.status_code >= 500:
            failures.append(f"{op.label} -> {r.status_code} {r.text[:200]}\n    {case.as_curl_command()[:800]}")

    run()


_LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_new_tokens")


def _bound_generation(body: dict, path: str) -> None:
    """Keep generated requests cheap on CPU: at most 8 new tokens (the no-max_tokens case has its own test)."""
    for key, value in list(body.items()):
        if key in _LENGTH_FIELDS and isinstance(value, int) and value > 8:
            body[key] = 8
        elif key == "n" and isinstance(value, int) and value > 2:
            body[key] = 2
        elif key == "sampling_params" and isinstance(value, dict):
            _bound_generation(value, path)
    if path in ("/v1/chat/completions", "/v1/completions") and "max_tokens" not in body:
        body["max_tokens"] = 8
    if path == "/generate" and isinstance(body.get("sampling_params"), dict):
        body["sampling_params"].setdefault("max_new_tokens", 8)
    elif path == "/generate" and "sampling_params" not in body:
        body["sampling_params"] = {"max_new_tokens": 8}


# Admin calls that change the server's state for every later request, and the call that puts it back.
_RESTORE = {
    "/pause_generation": ("POST", "/continue_generation", {}),
    "/slow_down": ("POST", "/slow_down", {"forward_sleep_time": None}),
    "/start_profile": ("POST", "/stop_profile", None),
    "/configure_logging": ("POST", "/configure_logging", {"log_requests": False, "log_level": "info",
                                                          "dump_requests_folder": "", "crash_dump_folder": ""}),
}


def test_property_based_run_on_every_route_with_no_key_the_client_key_and_the_admin_key(server):
    """Every operation of SGLang's OpenAPI document (not only the generation endpoints), its generated requests
    sent three times: without a key (must be 401), with the client key and with the admin key. No answer may be a
    5xx or take longer than a minute, the server must be alive after each operation and serve afterwards, and the
    log must hold no new traceback after the requests sent without the admin key. An admin call that changes the
    server's state for the later ones is followed by the call that puts it back (_RESTORE). It found: admin calls
    that stopped the scheduler (closed unless server.scheduler_stopping_routes; /update_weights_from_disk with an
    unknown load_format: request_validation.py), 500s and tracebacks on malformed input to SGLang's text utilities
    and Ollama / Vertex adapters and on admin mistakes (http_guard.py), and client input logged with a traceback by
    /v1/responses and /v1/messages/count_tokens (redaction.py) -- docs/RELIABILITY.md#generated-input."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings

    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json", headers=AUTH)
    ops = [r.ok() for r in schema.get_all_operations()]
    assert len(ops) >= 100, len(ops)
    keys = {"no key": {}, "client key": AUTH, "admin key": ADMIN_AUTH}
    failures: list[str] = []
    t0 = time.monotonic()
    for op in ops:
        answers: dict[str, set[int]] = {name: set() for name in keys}

        @settings(max_examples=ROUTE_EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
        @given(case=op.as_strategy())
        def run(case):
            if isinstance(case.body, dict):
                _bound_generation(case.body, op.path)
            traces = _tracebacks(server)
            for name, headers in keys.items():  # the admin key last: the traceback check is for the others
                if name == "admin key" and _tracebacks(server) > traces:
                    failures.append(f"{op.label}: a traceback in the log for a client's request\n"
                                    f"    {case.as_curl_command()[:600]}")
                try:
                    r = case.call(base_url=server.url, headers=headers, timeout=60)
                except Exception as e:  # noqa: BLE001 -- a hang or a dropped connection is a finding
                    failures.append(f"{op.label} ({name}): {type(e).__name__}\n    {case.as_curl_command()[:600]}")
                    continue
                answers[name].add(r.status_code)
                if r.status_code >= 500:
                    failures.append(f"{op.label} ({name}) -> {r.status_code} {r.text[:200]}\n"
                                    f"    {case.as_curl_command()[:600]}")
            restore = _RESTORE.get(op.path)
            if restore is not None:
                method, path, body = restore
                faults.send(server.url, method, path, None if body is None else json.dumps(body).encode(),
                            {**ADMIN_AUTH, "Content-Type": "application/json"}, timeout=120)

        run()
        assert server.proc.poll() is None, f"server died during {op.label}:\n{server.log_tail()}"
        if answers["no key"] - {401} and not op.path.startswith(OPEN_PATHS):
            failures.append(f"{op.label}: answered {sorted(answers['no key'])} without a key")
    elapsed = time.monotonic() - t0
    assert not failures, f"{len(failures)} findings in {elapsed:.0f}s:\n" + "\n".join(failures[:40])
    assert completes(server) and faults.send(server.url, "GET", "/health", None)[0] == 200


def _tracebacks(server) -> int:
    return server.log_path.read_text(errors="replace").count("Traceback (most recent call last)")


# ---------------------------------------------------------------------------------------------- security


def _routes(server) -> list[tuple[str, str]]:
    status, raw = faults.send(server.url, "GET", "/openapi.json", None, AUTH)
    assert status == 200
    routes = [(m.upper(), p) for p, ops in json.loads(raw)["paths"].items() for m in ops]
    # registered with include_in_schema=False, or not FastAPI routes at all
    routes += [("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/docs"), ("GET", "/redoc"),
               ("GET", "/openapi.json"), ("GET", "/metrics")]
    return [(m, re.sub(r"\{[^}]+\}", "x", p)) for m, p in routes if m != "HEAD"]


def test_every_route_but_probes_and_metrics_needs_the_key(server):
    """Generation, admin (/flush_cache, /update_weights_from_disk, /abort_request, /start_profile, ...), docs:
    401 without the key and with a wrong one; only the documented probe and metrics paths answer without it."""
    routes = _routes(server)
    admin = {"/flush_cache", "/update_weights_from_disk", "/abort_request", "/start_profile",
             "/release_memory_occupation", "/pause_generation", "/load_lora_adapter", "/configure_logging"}
    assert admin <= {p for _, p in routes}, "admin routes missing from the list under test"
    leaks = []
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong-key"}):
            status, body = faults.send(server.url, method, path, b"{}" if method in ("POST", "PUT") else None,
                                       {**headers, "Content-Type": "application/json"}, timeout=60)
            if path.startswith(OPEN_PATHS):
                if status == 401:
                    leaks.append(f"{method} {path}: 401 on a documented open path")
            elif status != 401:
                leaks.append(f"{method} {path} {'wrong key' if headers else 'no key'}: {status} {body[:120]!r}")
            elif not path.startswith(("/v1/messages", "/v1/systemone")) and faults.error_shape_problem(401, body):
                # (those two answer in Anthropic's / System One's own error format)
                leaks.append(f"{method} {path}: {faults.error_shape_problem(401, body)}")
    assert not leaks, "\n".join(leaks)
    assert server.proc.poll() is None and completes(server)


def _websocket_handshake(server, headers: dict[str, str]) -> bytes:
    """What a websocket handshake on /v1/realtime gets back: the status line, headers and any body."""
    import base64
    import socket

    host, port = server.url.removeprefix("http://").split(":")
    lines = ["GET /v1/realtime HTTP/1.1", f"Host: {host}:{port}", "Upgrade: websocket", "Connection: Upgrade",
             f"Sec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}", "Sec-WebSocket-Version: 13",
             *(f"{k}: {v}" for k, v in headers.items())]
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < _content_length(answer):
            chunk = sock.recv(4096)  # the headers and the body may come in separate reads
            if not chunk:
                break
            answer += chunk
            if answer.startswith(b"HTTP/1.1 101"):
                break
        return answer


def _content_length(answer: bytes) -> int:
    match = re.search(rb"(?im)^content-length:\s*(\d+)", answer.partition(b"\r\n\r\n")[0])
    return int(match.group(1)) if match else 0


def test_the_realtime_websocket_needs_the_key(server):
    """SGLang's key middleware passes websocket scopes: a handshake without any key was answered 101."""
    for headers in ({}, {"Authorization": "Bearer wrong-key"}, ADMIN_AUTH):
        answer = _websocket_handshake(server, headers)
        assert answer.startswith(b"HTTP/1.1 401"), (headers.keys(), answer[:200])
        assert faults.error_shape_problem(401, answer.partition(b"\r\n\r\n")[2]) is None, answer
    assert not _websocket_handshake(server, AUTH).startswith(b"HTTP/1.1 401")  # the key opens it: SGLang's handler


def test_routes_that_can_stop_the_scheduler_are_closed_to_the_admin_key_by_default(server):
    """One admin call to the expert-distribution recorder ended the server; the distributed weight-group routes
    held or ended the scheduler. Closed unless server.scheduler_stopping_routes."""
    from sglang_ext.patches.http_guard import SCHEDULER_STOPPING

    for path in sorted(SCHEDULER_STOPPING):
        status, body = faults.send(server.url, "POST", path, b"{}", {**ADMIN_AUTH, "Content-Type": "application/json"})
        assert status == 403 and b"scheduler_stopping_routes" in body, (path, status, body[:200])
        assert faults.send(server.url, "POST", path, b"{}", {})[0] == 401
    assert server.proc.poll() is None and completes(server)


def test_health_and_metrics_answer_without_the_key(server):
    for path in ("/health", "/metrics"):
        status, _ = faults.send(server.url, "GET", path, None)
        assert status == 200, path


def test_no_prompt_or_completion_text_in_the_log(server):
    """Every prompt of this module carried MARKER; a completion's text is checked too. Runs last in the module."""
    status, raw = faults.send(server.url, "POST", "/v1/chat/completions", json.dumps(
        {**faults.chat_body(MODEL, f"{MARKER} import os", 24, stream=False), "ignore_eos": True}).encode(),
        {**AUTH, "Content-Type": "application/json"})
    assert status == 200
    text = json.loads(raw)["choices"][0]["message"]["content"]
    log = server.log_path.read_text(errors="replace")
    assert MARKER not in log, "prompt text in the server log"
    assert len(text.strip()) < 12 or text.strip() not in log, "completion text in the server log"
    assert KEY not in log and ADMIN_KEY not in log, "API key in the server log"
