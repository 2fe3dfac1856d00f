"""The reliability fixes without a server: the HTTP guard as an ASGI app, request validation, DFlash's
req_to_token headroom, the idle-gauge publish, the launcher's bounded shutdown and port check, config fields.
The same behaviour against a real server: tests/integration/test_reliability_*.py."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import types

import pytest

from sglang_ext import names as env
from sglang_ext.patches import dflash_headroom, http_guard, idle_metrics, request_validation
from sglang_ext.settings import HttpSettings
from service import launcher
from service.config import ConfigError, parse_config

# ---------------------------------------------------------------------------------------------- http_guard


class FakeTM:
    served_model_name = "tiny"
    gracefully_exit = False

    class lora_registry:  # noqa: N801 -- stands in for SGLang's object
        @staticmethod
        def get_all_adapters():
            return {"a": types.SimpleNamespace(lora_name="my-adapter")}


def drive(app, scope: dict, incoming: list[dict]) -> list[dict]:
    """Run the ASGI `app` on `scope`, handing it `incoming` in turn; the messages it sent."""
    sent: list[dict] = []

    async def receive():
        return incoming.pop(0)

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


def run_asgi(app, method="POST", path="/v1/chat/completions", body=b"", headers=None, chunks=None):
    """Drive `app` like uvicorn; returns (status, headers, body, what the inner app received)."""
    raw = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    scope = {"type": "http", "method": method, "path": path, "headers": raw}
    incoming = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                for i, c in enumerate(chunks)] if chunks else [{"type": "http.request", "body": body,
                                                                 "more_body": False}]
    incoming.append({"type": "http.disconnect"})
    sent = drive(app, scope, incoming)
    start = next(m for m in sent if m["type"] == "http.response.start")
    out = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], dict((k.decode(), v.decode()) for k, v in start["headers"]), out


def echo_app(status=200, body=b'{"ok": true}', content_type=b"application/json"):
    seen = {}

    async def app(scope, receive, send):
        first = await receive()
        seen["body"] = first.get("body")
        seen["next"] = (await receive())["type"]  # after the body: the client's disconnect must come through
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type)]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    app.seen = seen
    return app


def guard(app, tm=None, limit=1000):
    return http_guard.HttpGuard(app, HttpSettings(max_request_bytes=limit), lambda: tm)


def shape(body: bytes) -> dict:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


def test_body_reaches_the_app_and_the_disconnect_after_it():
    app = echo_app()
    status, _, _ = run_asgi(guard(app, FakeTM()), body=b'{"model": "tiny"}',
                            headers={"content-type": "application/json"})
    assert status == 200
    assert app.seen == {"body": b'{"model": "tiny"}', "next": "http.disconnect"}


@pytest.mark.parametrize("flat, expected", [
    ({"object": "error", "message": "bad top_p", "type": "BadRequestError", "param": None, "code": 400},
     ("bad top_p", "invalid_request_error", None, 400)),
    ({"error": "Unauthorized"}, ("Unauthorized", "authentication_error", None, 401)),
    ({"detail": "Not Found"}, ("Not Found", "not_found_error", None, 404)),
])
def test_error_bodies_are_reshaped(flat, expected):
    status = expected[3]
    app = echo_app(status, json.dumps(flat).encode())
    code, headers, body = run_asgi(guard(app), method="GET", path="/v1/x")
    err = shape(body)
    assert code == status and (err["message"], err["type"], err["param"], err["code"]) == expected
    assert int(headers["content-length"]) == len(body)


def test_a_plain_text_500_becomes_json():
    app = echo_app(500, b"Internal Server Error", b"text/plain; charset=utf-8")
    code, headers, body = run_asgi(guard(app), method="GET", path="/x")
    assert code == 500 and headers["content-type"] == "application/json"
    assert shape(body)["message"] == "Internal server error"


def test_already_openai_shaped_and_anthropic_errors_are_left_alone():
    good = json.dumps({"error": {"message": "m", "type": "t", "param": None, "code": 400}}).encode()
    assert run_asgi(guard(echo_app(400, good)), method="GET", path="/v1/x")[2] == good
    anthropic = json.dumps({"type": "error", "error": {"type": "invalid_request_error", "message": "m"}}).encode()
    assert run_asgi(guard(echo_app(400, anthropic)), path="/v1/messages", body=b"{}",
                    headers={"content-type": "application/json"})[2] == anthropic


def test_server_file_paths_are_removed_from_messages():
    msg = 'boom\n  File "/srv/lib/sglang/http_server.py", line 1870, in openai_v1_chat'
    app = echo_app(400, json.dumps({"object": "error", "message": msg, "type": "x", "code": 400}).encode())
    assert shape(run_asgi(guard(app), method="GET", path="/x")[2])["message"] == "boom"


def test_an_error_that_quotes_pydantics_input_value_is_answered_without_it():
    """SGLang's /v1/responses answers a message list that fails validation with str(ValidationError), already in
    the OpenAI shape; pydantic quotes each offending value in it. The value is cut, the rest of the message kept."""
    quoted = ("1 validation error for ChatCompletionRequest\nmessages.0.content\n  Input should be a valid list "
              "[type=list_type, input_value='SECRET PROMPT, with a comma', input_type=str]")
    body = json.dumps({"error": {"message": quoted, "type": "invalid_request_error", "param": None, "code": 400}})
    out = json.loads(http_guard.normalise_error(400, "application/json", body.encode()))["error"]
    assert "SECRET" not in out["message"] and "input_value" not in out["message"]
    assert out["message"].endswith("Input should be a valid list [type=list_type, input_type=str]")
    assert (out["type"], out["code"]) == ("invalid_request_error", 400)
    clean = json.dumps({"error": {"message": "max_tokens: too big", "type": "invalid_request_error", "param": None,
                                  "code": 400}})
    assert http_guard.normalise_error(400, "application/json", clean.encode()) is None  # nothing to cut: as sent


def test_validation_messages_name_the_field_not_the_input():
    message, param = http_guard._validation_message([
        {"type": "int_parsing", "loc": ("body", "max_tokens"), "msg": "Input should be a valid integer",
         "input": "SECRET PROMPT"},
        {"type": "string_type", "loc": ("body", "stop", "list[str]", 0), "msg": "Input should be a valid string",
         "input": 1}])
    assert "SECRET" not in message and param == "max_tokens"
    assert message == "max_tokens: Input should be a valid integer; stop.0: Input should be a valid string"
    assert http_guard._validation_message([{"type": "json_invalid", "loc": ("body", 3), "msg": "JSON decode error",
                                            "ctx": {"error": "unexpected character"}}])[0] \
        == "the request body is not valid JSON (unexpected character)"


def test_declared_oversized_body_is_refused_before_the_app_sees_it():
    app = echo_app()
    code, headers, body = run_asgi(guard(app, limit=10), body=b"x" * 11,
                                   headers={"content-type": "application/json", "content-length": "11"})
    assert code == 413 and shape(body)["code"] == 413 and headers["connection"] == "close"
    assert app.seen == {}
    # Expect: 100-continue -- the client waits for the answer before sending: answered without reading
    code, _, _ = run_asgi(guard(app, limit=10), chunks=[], body=b"",
                          headers={"content-type": "application/json", "content-length": "11",
                                   "expect": "100-continue"})
    assert code == 413


def test_chunked_oversized_body_is_refused():
    app = echo_app()
    code, _, _ = run_asgi(guard(app, limit=10), chunks=[b"{" + b" " * 6, b" " * 6 + b"}"],
                          headers={"content-type": "application/json"})
    assert code == 413 and app.seen == {}


def test_json_that_is_not_an_object_is_a_400_but_invalid_json_goes_to_sglang():
    app = echo_app()
    code, _, body = run_asgi(guard(app), body=b"[1, 2]", headers={"content-type": "application/json"})
    assert code == 400 and "JSON object" in shape(body)["message"] and app.seen == {}
    run_asgi(guard(app), body=b"[1, 2", headers={"content-type": "application/json"})
    assert app.seen["body"] == b"[1, 2"


@pytest.mark.parametrize("model, known", [("tiny", True), ("tiny:my-lora", True), ("my-adapter", True),
                                          ("gpt-4o", False), (None, True)])
def test_unknown_models_get_a_404(model, known):
    app = echo_app()
    body = json.dumps({"messages": []} | ({"model": model} if model else {})).encode()
    code, _, out = run_asgi(guard(app, FakeTM()), body=body, headers={"content-type": "application/json"})
    if known:
        assert code == 200
    else:
        err = shape(out)
        assert code == 404 and err["param"] == "model" and "gpt-4o" in err["message"]


def test_draining_server_refuses_new_requests_but_not_probes():
    tm = FakeTM()
    tm.gracefully_exit = True
    code, headers, body = run_asgi(guard(echo_app(), tm), body=b"{}", headers={"content-type": "application/json"})
    assert code == 503 and headers["retry-after"] == "5" and shape(body)["code"] == 503
    assert run_asgi(guard(echo_app(), tm), method="GET", path="/health")[0] == 200
    assert run_asgi(guard(echo_app(), tm), method="GET", path="/metrics")[0] == 200


def test_guard_is_off_without_the_launcher_variable():
    assert http_guard.install({}) is False
    assert HttpSettings.from_env({}) is None
    s = HttpSettings.from_env({env.HTTP: HttpSettings(123).to_json()})
    assert s.max_request_bytes == 123
    with pytest.raises(ValueError):
        HttpSettings.from_env({env.HTTP: '{"max_request_bytes": -1}'})


@pytest.mark.parametrize("path", sorted(http_guard.SCHEDULER_STOPPING))
@pytest.mark.parametrize("opened", [False, True])
def test_routes_that_stop_the_scheduler_are_closed_unless_the_operator_opens_them(path, opened):
    """SGLang's expert-distribution routes raise in the scheduler of a server that does not record expert
    distributions: 403 for every key that gets past authentication, unless server.scheduler_stopping_routes."""
    app = echo_app()
    settings = HttpSettings(max_request_bytes=1000, scheduler_stopping_routes=opened)
    status, _, body = run_asgi(http_guard.HttpGuard(app, settings, lambda: FakeTM()), path=path, body=b"{}",
                               headers={"content-type": "application/json"})
    if opened:
        assert status == 200 and app.seen["body"] == b"{}"
    else:
        assert status == 403 and "scheduler_stopping_routes" in shape(body)["message"] and not app.seen
    refused = http_guard.HttpGuard(app, settings, lambda: FakeTM(), lambda scope: (401, "no key"))
    assert run_asgi(refused, path=path, body=b"{}")[0] == 401  # authentication still comes first
    env_json = HttpSettings(1000, scheduler_stopping_routes=opened).to_json()
    assert HttpSettings.from_env({env.HTTP: env_json}).scheduler_stopping_routes is opened


@pytest.mark.parametrize("body", [b"", b"[1]", b"null", b"not json"])
def test_routes_that_parse_their_own_body_get_a_json_object_or_a_400(body):
    """/add_external_corpus and /remove_external_corpus call `await request.json()` and `.get`/`**` on it: 500."""
    for path in sorted(http_guard.RAW_JSON_ROUTES):
        app = echo_app()
        status, _, out = run_asgi(guard(app, FakeTM()), path=path, body=body)
        assert status == 400 and "JSON object" in shape(out)["message"] and not app.seen, (path, body)
    assert run_asgi(guard(echo_app(), FakeTM()), path="/add_external_corpus", body=b"{}")[0] == 200


def test_a_refused_profile_request_is_a_400_not_a_500():
    """The scheduler's refusal (profiling already running, or none to stop) was re-raised as RuntimeError."""
    from fastapi import HTTPException

    class Mixin:
        async def _execute_profile(self, req):
            raise RuntimeError("Profiling is not in progress")

    http_guard._patch_profile(types.SimpleNamespace(TokenizerControlMixin=Mixin))
    with pytest.raises(HTTPException) as refused:
        asyncio.run(Mixin()._execute_profile(None))
    assert refused.value.status_code == 400 and "not in progress" in refused.value.detail


def raising_app(exc: Exception, started: int | None = None):
    """A handler that raises, behind Starlette's ServerErrorMiddleware (a 500 sent, then the exception re-raised);
    `started`: a response status sent before the raise (a stream that broke)."""
    async def app(scope, receive, send):
        await receive()
        if started is not None:
            await send({"type": "http.response.start", "status": started, "headers": []})
            raise exc
        await send({"type": "http.response.start", "status": 500, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"Internal Server Error", "more_body": False})
        raise exc

    return app


def test_a_handler_that_raises_on_malformed_input_answers_400_on_the_routes_known_to(caplog):
    """/parse_function_call {"text": ""}, /separate_reasoning {"reasoning_parser": ""}, /api/chat without messages:
    the handler raised, the client got a 500 and the log a traceback."""
    for path in sorted(http_guard.CLIENT_INPUT_ROUTES):
        status, _, body = run_asgi(guard(raising_app(IndexError("list index out of range"))), path=path,
                                   body=b'{"text": ""}', headers={"content-type": "application/json"})
        assert status == 400 and "IndexError" in shape(body)["message"], path
    assert "raised IndexError" in caplog.text and "Traceback" not in caplog.text
    with pytest.raises(IndexError):  # any other route: SGLang's 500, and the exception goes on to be logged
        run_asgi(guard(raising_app(IndexError())), path="/v1/chat/completions", body=b"{}")
    with pytest.raises(IndexError):  # a response already under way cannot become a 400
        run_asgi(guard(raising_app(IndexError(), started=200)), path="/api/chat", body=b"{}")


def test_an_ollama_stream_is_refused_before_it_starts():
    """A streaming /api/chat the tokenizer manager refuses (too long for the context) broke its 200 stream."""
    from starlette.responses import StreamingResponse

    class Serving:
        async def _stream_chat_response(self, refuse):
            async def chunks():
                if refuse:
                    raise ValueError("Requested token count exceeds the model's maximum context length")
                yield b"a"
                yield b"b"

            return StreamingResponse(chunks())

        _stream_generate_response = _stream_chat_response

    http_guard._patch_ollama_streams(types.SimpleNamespace(OllamaServing=Serving))
    with pytest.raises(ValueError):  # in the handler, before the response starts: CLIENT_INPUT_ROUTES makes it 400
        asyncio.run(Serving()._stream_generate_response(True))

    async def served():
        response = await Serving()._stream_chat_response(False)
        return [chunk async for chunk in response.body_iterator]

    assert asyncio.run(served()) == [b"a", b"b"]


def test_a_clients_invalid_request_is_logged_without_its_input_or_a_traceback():
    """/v1/responses and /v1/messages/count_tokens logged pydantic's error (quoting the prompt) with a traceback."""
    import io
    import logging

    from sglang_ext.patches import redaction

    out = io.StringIO()
    log = logging.getLogger("test-input-errors")
    log.addHandler(logging.StreamHandler(out))
    redaction._quiet_input_errors(types.SimpleNamespace(logger=log))
    for line, args in (("Error converting count_tokens request: %s", ("x",)), ("Error in preprocessing prompt inputs",
                                                                                 ())):
        try:
            raise ValueError("input_value='zq-secret prompt'")
        except ValueError:
            log.exception(line, *args)
    try:
        raise KeyError("a server bug")
    except KeyError:
        log.exception("Something else")  # not a client's request: keeps its traceback
    text = out.getvalue()
    assert "zq-secret" not in text and text.count("Traceback") == 1, text
    assert "Error converting count_tokens request: ValueError (a client's invalid request" in text


def run_websocket(app, extensions=True):
    """A websocket handshake as uvicorn hands it to the app: the messages the app sent back."""
    scope = {"type": "websocket", "path": "/v1/realtime", "headers": [],
             "extensions": {"websocket.http.response": {}} if extensions else {}}
    return drive(app, scope, [{"type": "websocket.connect"}, {"type": "websocket.disconnect", "code": 1000}])


def test_a_websocket_handshake_needs_the_key_like_an_http_request():
    """SGLang's key middleware passes non-HTTP scopes, so /v1/realtime accepted a handshake without any key."""
    async def accepting(scope, receive, send):
        await receive()
        await send({"type": "websocket.accept"})

    def refusing(scope):
        return (401, http_guard.UNAUTHENTICATED) if scope["type"] == "websocket" else None

    sent = run_websocket(http_guard.HttpGuard(accepting, HttpSettings(), lambda: None, refusing))
    assert [m["type"] for m in sent] == ["websocket.http.response.start", "websocket.http.response.body"]
    assert sent[0]["status"] == 401 and shape(sent[1]["body"])["type"] == "authentication_error"
    sent = run_websocket(http_guard.HttpGuard(accepting, HttpSettings(), lambda: None, refusing), extensions=False)
    assert sent == [{"type": "websocket.close", "code": 1008}]  # uvicorn answers the handshake 403
    sent = run_websocket(http_guard.HttpGuard(accepting, HttpSettings(), lambda: None, lambda scope: None))
    assert sent == [{"type": "websocket.accept"}]


# ---------------------------------------------------------------------------------------------- SGLang patches


def test_token_ids_outside_the_vocabulary_are_refused():
    request_validation.check_token_ids([0, 5, 4095], 4096)
    request_validation.check_token_ids([], 4096)
    for ids in ([-1], [4096], [1, 10**12]):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            request_validation.check_token_ids(ids, 4096)


def test_logprob_arguments_that_crash_the_scheduler_are_refused():
    from types import SimpleNamespace as Req

    ok = [Req(return_logprob=True, top_logprobs_num=0, logprob_start_len=-1),
          Req(return_logprob=True, top_logprobs_num=4096, logprob_start_len=0),
          Req(return_logprob=False, top_logprobs_num=10**6, logprob_start_len=-5),  # ignored without logprobs
          Req(return_logprob=True, top_logprobs_num=None, logprob_start_len=None)]
    for req in ok:
        request_validation.check_logprob_args(req, 4096)
    for req, field in ((Req(return_logprob=True, top_logprobs_num=4097, logprob_start_len=-1), "top_logprobs_num"),
                       (Req(return_logprob=True, top_logprobs_num=-1, logprob_start_len=-1), "top_logprobs_num"),
                       (Req(return_logprob=True, top_logprobs_num=1, logprob_start_len=-2), "logprob_start_len")):
        with pytest.raises(ValueError, match=field):
            request_validation.check_logprob_args(req, 4096)


def test_shape_errors_in_request_normalisation_become_client_errors():
    def boom(self):
        return [][0]

    wrapped = request_validation._shape_errors_are_client_errors(boom)
    with pytest.raises(ValueError, match="malformed request: IndexError"):
        wrapped(object())


def test_an_unknown_load_format_is_refused_before_it_reaches_the_loader():
    """/update_weights_from_disk {"load_format": "x"}: LoadConfig raised ValueError in the scheduler, which died."""
    launcher.activate_cpu_layer_here()  # SGLang's io_struct imports need the CPU stubs on a machine without a GPU
    from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

    loaded = []

    class Updater:
        def update_weights_from_disk(self, recv_req):
            loaded.append(recv_req.load_format)
            return "loaded"

    request_validation._patch_weight_updater(types.SimpleNamespace(SchedulerWeightUpdaterManager=Updater))
    out = Updater().update_weights_from_disk(UpdateWeightFromDiskReqInput(model_path="/m", load_format="x"))
    assert out.success is False and out.message.startswith("load_format: not a load format") and not loaded
    for fmt in (None, "auto", "safetensors"):
        assert Updater().update_weights_from_disk(UpdateWeightFromDiskReqInput(model_path="/m", load_format=fmt)) \
            == "loaded"


def test_dflash_row_headroom_covers_the_decode_reserve():
    # prepare_for_decode reserves 2 * block past the committed length (dflash_info_v2.py), page-rounded
    assert dflash_headroom.dflash_extra(16, 1) == 36 >= 2 * 16
    assert dflash_headroom.dflash_extra(16, 64) == 2 * 16 + 63 + 4


def test_a_tree_window_wider_than_the_block_is_reserved_and_fits_the_rows(monkeypatch):
    """A tree of width 41 (40 prefixes) on a 16-block drafter: 41 slots past the true length, which the host sees
    one step (<= 16 tokens) late -> the decode reserve and the rows grow by 41 + 16 - 32 = 25."""
    import types

    from sglang_ext import names
    from sglang_ext.controller.config import ControllerConfig
    from sglang_ext.settings import AdaptiveSettings, adaptive_settings

    monkeypatch.setenv(names.ADAPTIVE, AdaptiveSettings(ControllerConfig(candidates=(1, 4, 16, 41))).to_json())
    adaptive_settings.cache_clear()  # a fresh process
    assert dflash_headroom.tree_extra(16) == 25
    assert dflash_headroom.dflash_extra(16, 1) == 36 + 25
    seen = []
    info = types.SimpleNamespace(page_aligned_decode_alloc_lens=lambda reqs, *, reserve, page_size: seen.append(
        reserve))
    dflash_headroom._patch_decode_reserve(info)
    info.page_aligned_decode_alloc_lens([], reserve=2 * 16, page_size=1)
    assert seen == [32 + 25]
    monkeypatch.setenv(names.ADAPTIVE, AdaptiveSettings().to_json())
    assert dflash_headroom.tree_extra(16) == 25  # read once: the rows and the reserve keep one size
    adaptive_settings.cache_clear()  # a fresh process with chains only: no extra
    assert dflash_headroom.tree_extra(16) == 0
    adaptive_settings.cache_clear()


RESERVE_PROBE = r"""
import json, types
from sglang.srt.mem_cache import allocation_sizing as sizing
from sglang_ext.patches import dflash_headroom

# the spec config bags exist only inside a server: DFLASH_ADAPTIVE with the drafter's block of 16
sizing.get_alloc_len_per_decode = sizing.max_speculative_num_draft_tokens = lambda: 16
dflash_headroom._serves_dflash = lambda: True
dflash_headroom.install()
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.speculative import dflash_info_v2

kv = [(100, 100), (100, 132), (90, 170), (40, 200)]  # (committed, allocated): fresh, 2B ahead, part, all ahead
reqs = [types.SimpleNamespace(kv=types.SimpleNamespace(kv_committed_len=c, kv_allocated_len=a)) for c, a in kv]
estimate = ScheduleBatch._new_tokens_required_next_decode_spec_v2(None, reqs, 1)
_, _, allocated = dflash_info_v2.page_aligned_decode_alloc_lens(reqs, reserve=2 * 16, page_size=1)
print("RESULT" + json.dumps({"estimate": estimate, "allocated": allocated}))
"""


def test_the_schedulers_decode_memory_check_counts_what_a_tree_window_allocates():
    """check_decode_mem (SGLang's estimate of the next decode's KV slots) must equal what DFlash's
    prepare_for_decode allocates, tree window included: an estimate below it lets a full pool pass the check, and the
    allocation raises "Out of memory" in the scheduler instead of retract_decode freeing room."""
    from tests.conftest import child_result
    from sglang_ext.controller.config import ControllerConfig
    from sglang_ext.settings import AdaptiveSettings

    trees = AdaptiveSettings(ControllerConfig(candidates=(1, 16, 64))).to_json()
    got = child_result("-c", RESERVE_PROBE, **{env.ADAPTIVE: trees})
    assert got["allocated"] == (64 + 16) + (64 + 16 - 32) + (64 + 16 - 80) + 0
    assert got["estimate"] == got["allocated"]
    chains = AdaptiveSettings(ControllerConfig(candidates=(1, 4, 16))).to_json()
    got = child_result("-c", RESERVE_PROBE, **{env.ADAPTIVE: chains})
    assert got["estimate"] == got["allocated"] == 32 + 0 + 0 + 0


def test_idle_gauges_are_published_on_the_first_idle_pass_after_a_busy_publish():
    calls = []

    class Reporter:
        current_scheduler_metrics_enabled = True

        def __init__(self):
            self.metrics_collector = types.SimpleNamespace(last_log_time=100.0)

        def _maybe_log_idle_metrics(self):  # SGLang's: publishes when last_log_time is older than 30 s
            forced = self.metrics_collector.last_log_time == 0.0
            calls.append(forced)
            if forced:
                self.metrics_collector.last_log_time = 200.0

    mr = types.ModuleType("metrics_reporter")
    mr.SchedulerMetricsReporter = Reporter
    idle_metrics._patch(mr)
    r = Reporter()
    r._maybe_log_idle_metrics()      # first idle pass after a busy publish (last_log_time 100): forced
    r._maybe_log_idle_metrics()      # still idle: SGLang's own 30 s cadence
    r.metrics_collector.last_log_time = 300.0  # a busy publish happened
    r._maybe_log_idle_metrics()
    assert calls == [True, False, True]


# ---------------------------------------------------------------------------------------------- launcher, config


def test_config_defaults_and_environment():
    cfg = parse_config({"model": {"path": "/m"}})
    assert cfg.server.host == "127.0.0.1"
    assert cfg.server.max_request_bytes == 2 * 1024 * 1024 and cfg.server.shutdown_grace_seconds == 50
    server_env = launcher.server_env(cfg, base={})
    assert json.loads(server_env[env.HTTP])["max_request_bytes"] == 2 * 1024 * 1024
    assert json.loads(launcher.server_env(parse_config({"model": {"path": "/m"}, "server": {
        "max_request_bytes": None}}), base={})[env.HTTP])["max_request_bytes"] is None
    with pytest.raises(ConfigError, match="server.shutdown_grace_seconds"):
        parse_config({"model": {"path": "/m"}, "server": {"shutdown_grace_seconds": 0}})


def _supervise_script(tmp_path, child_code: str, grace: float) -> subprocess.Popen:
    script = tmp_path / "sup.py"
    script.write_text(textwrap.dedent(f"""
        import subprocess, sys
        from service.launcher import supervise
        child = subprocess.Popen([sys.executable, "-c", {child_code!r}], start_new_session=True)
        print(child.pid, flush=True)
        sys.exit(supervise(child, {grace}))
    """))
    return subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.getcwd()})


def _read_until_ready(sup) -> str:
    """The supervisor prints the child's pid, the child prints 'ready' once its own handler is set."""
    lines = [sup.stdout.readline().strip(), sup.stdout.readline().strip()]
    assert "ready" in lines, lines
    return next(line for line in lines if line != "ready")


def _wait_for_sigterm_handler(pid: int, timeout: float = 60) -> None:
    """Until `pid` catches SIGTERM (supervise() installed its handler): a signal before that would kill it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/status") as f:
            caught = int(next(line for line in f if line.startswith("SigCgt:")).split()[1], 16)
        if caught & (1 << (signal.SIGTERM - 1)):
            return
        time.sleep(0.05)
    raise AssertionError("supervise() never installed its SIGTERM handler")


def test_shutdown_is_bounded_by_the_grace_period(tmp_path):
    stubborn = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); "
                "time.sleep(600)")
    sup = _supervise_script(tmp_path, stubborn, grace=1.5)
    child = int(_read_until_ready(sup))
    _wait_for_sigterm_handler(sup.pid)
    t0 = time.monotonic()
    sup.send_signal(signal.SIGTERM)
    assert sup.wait(30) == launcher.KILLED_STATUS
    assert 1.4 < time.monotonic() - t0 < 10
    with pytest.raises(ProcessLookupError):
        os.killpg(child, 0)


def test_a_child_that_drains_in_time_gives_its_own_status(tmp_path):
    polite = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); "
              "print('ready', flush=True); time.sleep(600)")
    sup = _supervise_script(tmp_path, polite, grace=30)
    _read_until_ready(sup)
    _wait_for_sigterm_handler(sup.pid)
    sup.send_signal(signal.SIGTERM)
    assert sup.wait(30) == 0


def test_port_check_accepts_a_port_left_in_time_wait_and_refuses_a_listening_one():
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    with pytest.raises(ConfigError, match="already in use"):
        launcher.check_port_free("127.0.0.1", port)
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = listener.accept()
    conn.close()  # the server side closes first: its end of the connection stays in TIME_WAIT
    time.sleep(0.2)
    client.close()
    listener.close()
    launcher.check_port_free("127.0.0.1", port)  # a restarted server must not be refused for a minute


def test_an_empty_prompt_is_refused_before_it_reaches_the_scheduler():
    """An empty prompt alone in a prefill batch killed the scheduler (IndexError in _get_pruned_states)."""
    for ids in (None, [7], "text"):  # input_embeds requests carry no ids; ids and text are checked elsewhere
        request_validation.check_prompt_not_empty(ids)
    with pytest.raises(ValueError, match="the prompt is empty"):
        request_validation.check_prompt_not_empty([])
