"""HTTP hardening of SGLang's server (all devices), installed from the plugin into the HTTP server process.

Active only under `dflash-serve` (the launcher sets ``DFLASH_SERVE_HTTP``, JSON settings); a plain `sglang serve`
in the same environment is unchanged. SGLang 0.5.23 behaviours this fixes (tests/integration/test_reliability_*):

1. **Error shape.** Error responses come in five shapes: ``{"object": "error", "message", "type", "param",
   "code"}`` (flat: ``OpenAIServingBase.create_error_response`` and the HTTPException / RequestValidationError
   handlers), ``{"error": "Unauthorized"}`` (utils/auth.py), ``{"detail": ...}`` (Starlette 404/405/413),
   ``text/plain`` "Internal Server Error", and the OpenAI shape for /v1/responses. Every error response with a body
   leaves as ``{"error": {"message", "type", "param", "code"}}`` (code = the HTTP status, as in SGLang's in-stream
   errors). /v1/messages (Anthropic's shape) and /v1/systemone (documented 422 list) are left alone.
2. **Validation messages** were ``str(exc)``: they echo the client's input (prompt text) and name server files
   (``File "/.../http_server.py", line 1870``). Now ``loc: msg`` per error, with ``param`` set.
3. **Body limit** (``max_request_bytes``): 413 from the Content-Length header before anything parses the body,
   and while reading a chunked body. Without it a prompt of megabytes is tokenized (seconds of CPU) before the
   context-length check rejects it. The rest of the body is read and dropped (up to DRAIN_CAP) before
   the answer, so clients see the 413 instead of a connection reset.
4. **Non-object JSON bodies** (``[1, 2]``) got a 500: ``ChatCompletionRequest``'s before-validator calls ``.get``.
5. **Unknown models** were served (any ``model`` string answered 200). The generation endpoints now answer 404
   ``model_not_found`` unless the name is the served name, ``<served>:<lora adapter>`` or a loaded adapter.
6. **Authentication first, and the client key is not an admin key.** SGLang's API-key middleware sits inside
   this one, so a wrong model name was answered 404 naming the served model before the key was checked, and a
   body was read and parsed for anybody. And its `AuthLevel.ADMIN_OPTIONAL` routes (``/configure_logging``,
   ``/flush_cache``, ``/abort_request``, ``/pause_generation``, ``/update_weights_*``, LoRA loading, profiling:
   utils/auth.py ``decide_request_auth``) take the API key when no admin key is set, so every client was an admin.
   Now SGLang's own decision runs first, on SGLang's own route levels: a normal route needs the API key (401), an
   admin route the admin key (401 without a valid key, 403 for the client key). Retired by upstream making those
   routes ``ADMIN_FORCE`` (the FIXME above ``_admin_api_key_missing_response``) and ordering auth before the
   guard's checks.
7. **Draining.** After SIGTERM SGLang reports /health 503 but keeps admitting new requests, and its drain waits
   until no request is left -- under steady load it never ends. New requests now get 503 with ``Retry-After``;
   in-flight ones finish (the launcher bounds the wait: ``server.shutdown_grace_seconds``).
8. **Routes that stop the scheduler** (found by the property-based run on every route, with the admin key):
   ``/start_expert_distribution_record`` (and its stop and dump) raise in the scheduler unless SGLang records expert
   distributions, and the server ends; ``/send_weights_to_remote_instance`` ended it too, and
   ``/init_weights_update_group`` with an address that does not resolve held the scheduler (no request served) for
   minutes while torch.distributed retried; ``/resume_memory_occupation`` of memory not released raised KeyError
   in the scheduler (``/release_memory_occupation`` asserts there that the server is idle). Those, and the other
   two routes that join or use such a group (SCHEDULER_STOPPING), answer 403 to every key unless the operator sets
   ``server.scheduler_stopping_routes``. Retired when upstream answers these mistakes with an error instead of
   raising in the scheduler, and the group routes wait for their peer off the scheduler's loop.
9. **Admin routes answering 500 to an admin's mistake** (found by the property-based run on every route):
   ``/add_external_corpus`` and ``/remove_external_corpus`` without a JSON object body (their handlers parse it
   themselves), ``/start_profile`` while a profile runs and ``/stop_profile`` while none does (the scheduler's
   refusal re-raised as RuntimeError in ``TokenizerControlMixin._execute_profile``). Now 400. Retired when those
   handlers answer 400 themselves.
10. **Handlers that raise on a client's malformed input** (found by the property-based run on every route): 500
   and a traceback in the log from ``/parse_function_call`` (``{"text": ""}``), ``/separate_reasoning``
   (``"reasoning_parser": ""``), SGLang's Ollama routes (``/api/chat`` without messages; a streaming request
   refused by the tokenizer manager broke its 200 stream) and ``/vertex_generate``, ``/v1/loads``. On those routes
   (CLIENT_INPUT_ROUTES) a 500 is held until the handler is done: if the handler raised, the client gets a 400 naming
   the exception type and the log one line. Retired when upstream's handlers validate their input.
11. **Websockets.** SGLang's API-key middleware passes every scope that is not ``http``, so a websocket handshake
   on ``/v1/realtime`` (``openai_v1_realtime_transcription``) was accepted (101) without any key. A handshake is
   now authorised like an HTTP request to its route and refused (401) before it is accepted. Retired by upstream's
   middleware checking ``websocket`` scopes too.
11. **Pydantic's quoted input.** A handler that answers 400 with ``str(ValidationError)`` in the OpenAI shape
   (``/v1/responses`` for a message list that fails validation) quoted each offending value (``input_value=...``)
   back; it is cut. Retired when those handlers answer with the field and the reason only.

The middleware wraps the whole Starlette stack (outside SGLang's API-key middleware and Starlette's
ServerErrorMiddleware), so it sees every response, 401 and 500 included. It is pure ASGI and hands the original
``receive`` on after replaying a buffered body, so SGLang still sees client disconnects.
"""
from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from sglang_ext.patches.wrap import when_imported, wrap
from sglang_ext.settings import HttpSettings

logger = logging.getLogger(__name__)

# Answered by SGLang in another API's error format: leave their errors as they are.
FOREIGN_ERROR_SHAPES = ("/v1/messages", "/v1/systemone")
# Probes keep answering while draining (SGLang's /health says 503 itself).
PROBES = ("/health", "/ready", "/metrics")
MODEL_CHECKED = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
# Admin routes that stop the scheduler (and so every request) with one call: the expert-distribution recorder's, on a
# server that does not record expert distributions (eplb/expert_distribution.py's no-op recorder raises in the
# scheduler's expert_distribution_handle; the server ends); those that make the scheduler join or use a
# torch.distributed group with a peer the request names (it waits for the peer, minutes for an address that does
# not resolve, or raises: /send_weights_to_remote_instance ended the server); and the memory release and resume
# (scheduler_components/weight_updater.py: an `assert` that the server is idle, a KeyError for a tag not released).
SCHEDULER_STOPPING = frozenset({"/start_expert_distribution_record", "/stop_expert_distribution_record",
                                "/dump_expert_distribution_record", "/init_weights_update_group",
                                "/update_weights_from_distributed", "/init_weights_send_group_for_remote_instance",
                                "/send_weights_to_remote_instance", "/release_memory_occupation",
                                "/resume_memory_occupation"})
SCHEDULER_STOPPING_CLOSED = ("this route can stop the scheduler and is closed to every key; the operator opens it "
                             "to the admin key with server.scheduler_stopping_routes: true")
# Handlers that parse the body themselves (`await request.json()`, then `.get` or `**`): no body, or one that is
# not a JSON object, raised in the handler (500).
RAW_JSON_ROUTES = frozenset({"/add_external_corpus", "/remove_external_corpus"})
# Handlers that raise on malformed input (found by the property-based run on every route; 500 and a traceback):
# SGLang's text utilities and its Ollama / Vertex adapters (Ollama's streams: _patch_ollama_streams).
CLIENT_INPUT_ROUTES = frozenset({"/parse_function_call", "/separate_reasoning", "/api/chat", "/api/generate",
                                 "/vertex_generate", "/v1/loads"})
_BODY_METHODS = ("POST", "PUT", "PATCH")
_MAX_ERROR_BODY = 256 * 1024
DRAIN_CAP = 32 * 1024 * 1024  # most of a refused body read (and dropped) so the client sees the 413
_FILE_LINE = re.compile(r'\s*File "[^"]*", line \d+[^\n]*')
# pydantic's own message quotes each offending value ("[type=..., input_value=<the value>, input_type=...]"); a
# handler that answers 400 with str(ValidationError) (SGLang's /v1/responses for a message list) would echo the
# client's input
_PYDANTIC_INPUT = re.compile(r"input_value=.*?, input_type=", re.DOTALL)


# ---------------------------------------------------------------------------------------------- error bodies

def error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 403:
        return "permission_error"
    if status == 404:
        return "not_found_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(status: int, message: str, param: str | None = None, type_: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_ or error_type(status), "param": param,
                                 "code": status}}).encode()


def _clean(message: Any) -> str:
    text = message if isinstance(message, str) else json.dumps(message, default=str)
    text = _PYDANTIC_INPUT.sub("input_type=", _FILE_LINE.sub("", text)).strip()
    return text[:2000] + "..." if len(text) > 2000 else text


def _validation_message(errors) -> tuple[str, str | None]:
    """`loc: msg; ...` without the offending input; param = the first error's field path."""
    parts, param = [], None
    for err in errors or []:
        if err.get("type") == "json_invalid":
            parts.append(f"the request body is not valid JSON ({(err.get('ctx') or {}).get('error', 'decode error')})")
            continue
        raw_loc = list(err.get("loc") or ())
        if raw_loc == ["body"] and err.get("type") == "missing":
            parts.append("the request body is missing")
            continue
        loc = [str(p) for p in raw_loc if p not in ("body", "query", "header", "path")]
        # pydantic's union branches appear in the path as type names ("list[str]"): not a field
        loc = [p for p in loc if not re.search(r"[\[\]]", p) and p not in ("str", "int", "float", "bool")]
        where = ".".join(loc)
        param = param or where or None
        msg = (err.get("msg") or "invalid value").strip()
        parts.append(f"{where}: {msg}" if where else msg)
    text = "; ".join(dict.fromkeys(parts)) or "invalid request"
    return (text[:1000] + "..." if len(text) > 1000 else text), param


def normalise_error(status: int, content_type: str, body: bytes) -> bytes | None:
    """The OpenAI-shaped body for an error response, or None to leave it unchanged."""
    if not body.strip():
        return None
    data: Any = None
    if "json" in content_type:
        try:
            data = json.loads(body)
        except ValueError:
            data = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            if {"message", "type", "param", "code"} <= set(err) and not _PYDANTIC_INPUT.search(err["message"]):
                return None
            return error_body(status, _clean(err["message"]), err.get("param"), err.get("type"))
        if isinstance(err, str):
            return error_body(status, _clean(err))
        if "message" in data:
            param = data.get("param") if isinstance(data.get("param"), str) else None
            return error_body(status, _clean(data["message"]), param)
        if "detail" in data:
            detail = data["detail"]
            if isinstance(detail, list):
                message, param = _validation_message(detail)
                return error_body(status, message, param)
            return error_body(status, _clean(detail))
        return error_body(status, _clean(data))
    text = body.decode("utf-8", "replace").strip()
    if status >= 500 and text in ("Internal Server Error", ""):
        text = "Internal server error"
    return error_body(status, _clean(text))


# ---------------------------------------------------------------------------------------------- middleware

def _header(scope, name: bytes) -> str | None:
    for k, v in scope.get("headers") or ():
        if k.lower() == name:
            return v.decode("latin-1")
    return None


async def _respond(send, status: int, body: bytes, extra: list[tuple[bytes, bytes]] = ()) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class _TooLarge(Exception):
    def __init__(self, body_done: bool = False):
        super().__init__()
        self.body_done = body_done  # the client has sent its whole body already


class _ClientGone(Exception):
    pass


class HttpGuard:
    """Outermost ASGI middleware; `tokenizer_manager()` returns SGLang's (None before start-up)."""

    def __init__(self, app, settings: HttpSettings, tokenizer_manager, authorise=lambda scope: None):
        """`authorise(scope)`: None to let the request in, else (status, message)."""
        self.app = app
        self.settings = settings
        self.tokenizer_manager = tokenizer_manager
        self.authorise = authorise

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket":
            return await self._websocket(scope, receive, send)
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method = scope.get("path", ""), scope.get("method", "GET")
        refusal = self.authorise(scope)
        if refusal is not None:
            status, message = refusal
            return await _respond(send, status, error_body(status, message))
        if path.rstrip("/") in SCHEDULER_STOPPING and not self.settings.scheduler_stopping_routes:
            return await _respond(send, 403, error_body(403, SCHEDULER_STOPPING_CLOSED))
        if path.startswith(FOREIGN_ERROR_SHAPES):
            return await self.app(scope, receive, send)
        tm = self.tokenizer_manager()
        if tm is not None and getattr(tm, "gracefully_exit", False) and not path.startswith(PROBES):
            return await _respond(send, 503, error_body(
                503, "the server is shutting down and accepts no new requests; retry on another instance"),
                [(b"retry-after", b"5"), (b"connection", b"close")])

        limit = self.settings.max_request_bytes
        if method in _BODY_METHODS:
            length = _header(scope, b"content-length")
            if limit is not None and length is not None and length.strip().isdigit() and int(length) > limit:
                return await self._too_large(scope, receive, send, limit)
            ctype = (_header(scope, b"content-type") or "application/json").split(";")[0].strip().lower()
            if ctype == "application/json" or ctype.endswith("+json"):
                try:
                    body = await self._read_body(receive, limit)
                except _TooLarge as e:
                    return await self._too_large(scope, receive, send, limit, body_done=e.body_done)
                except _ClientGone:
                    return None
                refusal = self._check_body(path, body, tm)
                if refusal is not None:
                    return await _respond(send, *refusal)
                receive = _replay(body, receive)
        if path.rstrip("/") not in CLIENT_INPUT_ROUTES:
            return await self.app(scope, receive, self._normalising_send(send))
        await self._client_input_route(scope, receive, send, method, path)

    async def _client_input_route(self, scope, receive, send, method: str, path: str) -> None:
        """A route whose handler raises on malformed input (CLIENT_INPUT_ROUTES): its 5xx is held until the handler
        is done; if the handler raised (ServerErrorMiddleware answers 500, then re-raises), the client gets a 400
        and the log one line instead of the 500 and a traceback."""
        held: list[dict] = []
        started = False

        async def holding(message):
            nonlocal started
            if held or (message["type"] == "http.response.start" and message["status"] >= 500):
                held.append(message)
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, self._normalising_send(holding))
        except Exception as exc:  # noqa: BLE001 -- what the handler raised on the client's input
            if started:
                raise
            logger.warning("dflash-serve: %s %s: the handler raised %s on the request's input; answered 400",
                           method, path, type(exc).__name__)
            return await _respond(send, 400, error_body(
                400, f"{path} could not process this request ({type(exc).__name__}); check its fields"))
        for message in held:
            await send(message)

    async def _websocket(self, scope, receive, send) -> None:
        """A websocket handshake (SGLang's /v1/realtime) is authorised as an HTTP request to its route: SGLang's
        API-key middleware lets every non-HTTP scope through. Refused: the HTTP status and error body, before the
        connection is accepted (a server without the ASGI denial extension answers 403)."""
        refusal = self.authorise(scope)
        if refusal is None:
            return await self.app(scope, receive, send)
        message = await receive()
        if message["type"] != "websocket.connect":
            return None
        status, text = refusal
        if "websocket.http.response" not in (scope.get("extensions") or {}):
            return await send({"type": "websocket.close", "code": 1008})
        body = error_body(status, text)
        await send({"type": "websocket.http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "websocket.http.response.body", "body": body, "more_body": False})

    async def _too_large(self, scope, receive, send, limit: int, body_done: bool = False) -> None:
        # Read and drop what the client is still sending (bounded; costs bandwidth, not tokenization): a socket
        # closed with unread data is reset by the kernel, and clients then report the reset, not this 413. A
        # client that asked `Expect: 100-continue` has sent nothing and gets the answer at once.
        if not body_done and (_header(scope, b"expect") or "").strip().lower() != "100-continue":
            size = 0
            while size <= DRAIN_CAP:
                message = await receive()
                if message["type"] != "http.request":
                    return None
                size += len(message.get("body", b""))
                if not message.get("more_body", False):
                    break
        await _respond(send, 413, error_body(
            413, f"request body larger than {limit} bytes (server.max_request_bytes)"), [(b"connection", b"close")])

    @staticmethod
    async def _read_body(receive, limit: int | None) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # client left before sending the body
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if limit is not None and size > limit:
                raise _TooLarge(body_done=not message.get("more_body", False))
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _check_body(self, path: str, body: bytes, tm) -> tuple[int, bytes] | None:
        head = body.lstrip()[:1]
        if path in RAW_JSON_ROUTES and head != b"{":
            return 400, error_body(400, "the request body must be a JSON object")
        if head and head != b"{":
            try:
                json.loads(body)
            except ValueError:
                return None  # not JSON at all: SGLang's own validation error (400), reshaped on the way out
            return 400, error_body(400, "the request body must be a JSON object")
        if not self.settings.check_model or tm is None or path not in MODEL_CHECKED:
            return None
        try:
            model = json.loads(body).get("model")
        except (ValueError, AttributeError):
            return None
        if not isinstance(model, str) or _model_known(tm, model):
            return None
        return 404, error_body(404, f"The model `{model}` does not exist; this server serves "
                                    f"`{tm.served_model_name}` (GET /v1/models)", "model", "invalid_request_error")

    @staticmethod
    def _normalising_send(send):
        held: dict | None = None
        chunks: list[bytes] = []

        async def wrapped(message):
            nonlocal held
            kind = message["type"]
            if kind == "http.response.start":
                if message["status"] >= 400:
                    held = message
                    return
                return await send(message)
            if kind == "http.response.body" and held is not None:
                chunks.append(message.get("body", b""))
                more = message.get("more_body", False)
                if more and sum(map(len, chunks)) < _MAX_ERROR_BODY:
                    return
                start, held = held, None
                body = b"".join(chunks)
                chunks.clear()
                headers = list(start.get("headers") or [])
                new = None
                if not more:
                    ctype = next((v.decode("latin-1") for k, v in headers if k.lower() == b"content-type"), "")
                    try:
                        new = normalise_error(start["status"], ctype.lower(), body)
                    except Exception:  # never turn an error response into a crash
                        logger.exception("dflash-serve: could not reshape an error response")
                if new is not None:
                    body = new
                    headers = [(k, v) for k, v in headers if k.lower() not in (b"content-type", b"content-length")]
                    headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                await send({**start, "headers": headers})
                return await send({"type": "http.response.body", "body": body, "more_body": more})
            return await send(message)

        return wrapped


def _replay(body: bytes, receive):
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # http.disconnect when the client leaves: SGLang aborts on it

    return replayed


def _model_known(tm, model: str) -> bool:
    served = getattr(tm, "served_model_name", None)
    if served is None or model == served or model.startswith(f"{served}:"):
        return True
    try:
        return model in {ref.lora_name for ref in tm.lora_registry.get_all_adapters().values()}
    except Exception:
        return False


# ---------------------------------------------------------------------------------------------- installation

def _validation_handler(original):
    async def handler(request, exc):
        if request.url.path.startswith(FOREIGN_ERROR_SHAPES):
            return await original(request, exc)
        from starlette.responses import Response

        errors = exc.errors()
        if any(list(e.get("loc") or ())[:2] == ["header", "content-type"] for e in errors):
            return Response(error_body(415, "Content-Type must be application/json", "content-type"),
                            status_code=415, media_type="application/json")
        message, param = _validation_message(errors)
        return Response(error_body(400, message, param), status_code=400, media_type="application/json")

    return handler


UNAUTHENTICATED = "missing or wrong API key: send `Authorization: Bearer <key>`"
ADMIN_ONLY = "this route is for the admin key only (server.admin_api_key_env); the client key cannot use it"


def _authoriser(hs: ModuleType):
    """SGLang's own decision (utils/auth.py) on SGLang's own route levels, with admin routes closed to the client
    key: `ADMIN_OPTIONAL` is asked as `ADMIN_FORCE`. The keys are read per request: the serving config is
    published after this patch runs."""
    from sglang.srt.utils import auth

    def authorise(scope) -> tuple[int, str] | None:
        serving = hs.get_serving()
        level = auth._get_auth_level_from_app_and_scope(hs.app, scope)

        def allowed(as_level) -> bool:
            return auth.decide_request_auth(
                method=scope.get("method", "GET"), path=scope.get("path", ""),
                authorization_header=_header(scope, b"authorization"), api_key=serving.api_key,
                admin_api_key=serving.admin_api_key, auth_level=as_level).allowed

        if level is auth.AuthLevel.NORMAL:
            return None if allowed(level) else (401, UNAUTHENTICATED)
        if allowed(auth.AuthLevel.ADMIN_FORCE):
            return None
        return (403, ADMIN_ONLY) if allowed(auth.AuthLevel.NORMAL) else (401, UNAUTHENTICATED)

    return authorise


def _patch(hs: ModuleType, settings: HttpSettings) -> None:
    app = hs.app
    authorise = _authoriser(hs)

    def tokenizer_manager():
        state = getattr(hs, "_global_state", None)
        return getattr(state, "tokenizer_manager", None)

    def make(build):
        # once per app, with the wrap: the validation handler and FastAPI's own body limit
        from fastapi.exceptions import RequestValidationError

        original = app.exception_handlers.get(RequestValidationError)
        if original is not None:
            app.exception_handlers[RequestValidationError] = _validation_handler(original)
        if settings.max_request_bytes is not None and hasattr(app, "max_body_size"):
            app.max_body_size = settings.max_request_bytes  # FastAPI's own limit: bodies this middleware does not read

        def build_middleware_stack():
            return HttpGuard(build(), settings, tokenizer_manager, authorise)

        return build_middleware_stack

    wrap(app, "build_middleware_stack", make)


def _patch_profile(mixin: ModuleType) -> None:
    """A profile request the scheduler refuses (profiling already running, or not running when stopped) raised
    RuntimeError in the handler of /start_profile and /stop_profile: 500. Now a 400 with the scheduler's reason."""
    def make(original):
        async def _execute_profile(self, req):
            try:
                return await original(self, req)
            except RuntimeError as e:
                from fastapi import HTTPException

                raise HTTPException(status_code=400, detail=f"profile request refused: {e}") from None

        return _execute_profile

    wrap(mixin.TokenizerControlMixin, "_execute_profile", make)


def _patch_ollama_streams(ollama: ModuleType) -> None:
    """Ollama's streaming /api/chat and /api/generate start their 200 before the request is validated, so a request
    the tokenizer manager refuses (a ValueError: too long for the context, ...) broke the stream with a traceback.
    The first chunk is now produced before the response starts: a refusal raises in the handler, where the
    CLIENT_INPUT_ROUTES boundary answers it 400."""
    def make(original):
        async def stream_response(self, *args, **kwargs):
            response = await original(self, *args, **kwargs)
            chunks = response.body_iterator
            try:
                first = await chunks.__anext__()
            except StopAsyncIteration:
                return response

            async def from_the_first():
                yield first
                async for chunk in chunks:
                    yield chunk

            response.body_iterator = from_the_first()
            return response

        return stream_response

    for name in ("_stream_chat_response", "_stream_generate_response"):
        wrap(ollama.OllamaServing, name, make)


def install(environ: Mapping[str, str] = os.environ) -> bool:
    settings = HttpSettings.from_env(environ)
    if settings is None:
        return False
    when_imported("sglang.srt.entrypoints.http_server", lambda hs: _patch(hs, settings))
    when_imported("sglang.srt.managers.tokenizer_control_mixin", _patch_profile)
    when_imported("sglang.srt.entrypoints.ollama.serving", _patch_ollama_streams)
    return True
