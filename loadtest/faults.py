"""Faults for the reliability tests and the soak (`loadtest/soak.py`): clients that vanish mid-stream, malformed
requests with the status and error shape they must get, and the server-side numbers that show whether anything
was left behind. Standard library only (asyncio sockets): a client that drops must really close its TCP
connection, which pooled HTTP clients do not promise.
"""
from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlsplit

from loadtest import server_metrics

# ---------------------------------------------------------------------------------------------- requests


def chat_body(model: str, content: str, max_tokens: int, *, stream: bool = True, **extra) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


@dataclass
class Dropped:
    """A streaming request whose client closed the connection on purpose."""

    status: int | None        # HTTP status, if the headers arrived before the drop
    bytes_received: int       # body bytes read before the drop
    streaming: bool           # at least one SSE data chunk arrived: the request was decoding when dropped


async def stream_and_drop(url: str, body: dict, headers: dict[str, str] | None = None, *, drop_after: float = 0.5,
                          wait_first_chunk: float = 0.0) -> Dropped:
    """POST a streaming request, read for `drop_after` seconds, then close the socket.

    With `wait_first_chunk` > 0 the clock starts at the first SSE chunk (waiting at most that long for it), so the
    request is known to be decoding -- not queued -- when the client vanishes."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 80)
    payload = json.dumps(body).encode()
    head = [f"POST {parts.path or '/'} HTTP/1.1", f"Host: {parts.netloc}", "Content-Type: application/json",
            f"Content-Length: {len(payload)}", "Accept: text/event-stream"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
    status, received, streaming, buf = None, 0, False, b""
    try:
        await writer.drain()
        deadline = time.monotonic() + (wait_first_chunk if wait_first_chunk > 0 else drop_after)
        first_seen = wait_first_chunk <= 0
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                if first_seen:
                    break
                first_seen, deadline = True, time.monotonic() + drop_after  # no chunk in time: drop anyway
                continue
            try:
                data = await asyncio.wait_for(reader.read(65536), left)
            except asyncio.TimeoutError:
                continue
            if not data:
                break
            buf += data
            if status is None and b"\r\n\r\n" in buf:
                line = buf.split(b"\r\n", 1)[0].split()
                status = int(line[1]) if len(line) > 1 and line[1].isdigit() else None
                buf = buf.split(b"\r\n\r\n", 1)[1]
            if status is not None:
                received += len(buf)
                if b"data: {" in buf and not streaming:
                    streaming = True
                    if not first_seen:
                        first_seen, deadline = True, time.monotonic() + drop_after
                buf = buf[-16:]
    finally:
        writer.transport.abort()  # no FIN dance: the client is gone
    return Dropped(status, received, streaming)


# ---------------------------------------------------------------------------------------------- bad input


@dataclass(frozen=True)
class BadRequest:
    name: str
    path: str
    body: bytes
    content_type: str | None = "application/json"
    expect: tuple[int, ...] = (400,)
    method: str = "POST"


def bad_requests(model: str, context_length: int) -> list[BadRequest]:
    """One request per kind of client mistake the issue lists, with the status it must get."""
    chat = "/v1/chat/completions"

    def body(**kw) -> bytes:
        b = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, **kw}
        return json.dumps({k: v for k, v in b.items() if v is not None}).encode()

    long_prompt = "hello world " * context_length  # ~2 tokens a repeat: twice the context
    return [
        BadRequest("body is not JSON", chat, b'{"model": "x", "messages": [', ),
        BadRequest("body is a JSON array", chat, b"[1, 2, 3]"),
        BadRequest("empty body", chat, b""),
        BadRequest("messages is a string", chat, body(messages="hello")),
        BadRequest("message without role", chat, body(messages=[{"content": "hi"}])),
        BadRequest("max_tokens is a string", chat, body(max_tokens="ten")),
        BadRequest("max_tokens negative", chat, body(max_tokens=-5)),
        BadRequest("max_tokens huge", chat, body(max_tokens=10**12)),
        BadRequest("max_tokens past the context", chat, body(max_tokens=context_length * 4)),
        BadRequest("temperature negative", chat, body(temperature=-1)),
        BadRequest("top_p above 1", chat, body(top_p=5)),
        BadRequest("prompt over the context length", chat,
                   body(messages=[{"role": "user", "content": long_prompt}])),
        BadRequest("unknown model", chat, body(model="gpt-does-not-exist"), expect=(404,)),
        BadRequest("unknown model, streaming", chat, body(model="gpt-does-not-exist", stream=True), expect=(404,)),
        BadRequest("stop is a number", chat, body(stop=123)),
        BadRequest("stop is a list of numbers", chat, body(stop=[1, 2])),
        BadRequest("logit_bias key not a token id", chat, body(logit_bias={"abc": 5})),
        BadRequest("logit_bias value not a number", chat, body(logit_bias={"5": "x"})),
        BadRequest("logit_bias token outside the vocabulary", chat, body(logit_bias={"99999999": 5})),
        BadRequest("wrong content type", chat, body(), content_type="text/plain", expect=(415,)),
        BadRequest("no content type", chat, body(), content_type=None, expect=(415,)),
        BadRequest("completions: prompt token ids outside the vocabulary", "/v1/completions",
                   json.dumps({"model": model, "prompt": [-38721], "max_tokens": 2}).encode()),
        BadRequest("completions: max_tokens negative", "/v1/completions",
                   json.dumps({"model": model, "prompt": "x", "max_tokens": -1}).encode()),
        BadRequest("completions: unknown model", "/v1/completions",
                   json.dumps({"model": "nope", "prompt": "x", "max_tokens": 2}).encode(), expect=(404,)),
        BadRequest("generate: input ids outside the vocabulary", "/generate",
                   json.dumps({"input_ids": [1, 10**9], "sampling_params": {"max_new_tokens": 2}}).encode()),
        BadRequest("generate: more top logprobs than the vocabulary", "/generate",
                   json.dumps({"text": "x", "return_logprob": True, "top_logprobs_num": 10**6,
                               "sampling_params": {"max_new_tokens": 2}}).encode()),
        BadRequest("generate: logprob_start_len below -1", "/generate",
                   json.dumps({"text": "x", "return_logprob": True, "logprob_start_len": -5,
                               "sampling_params": {"max_new_tokens": 2}}).encode()),
        BadRequest("generate: empty prompt", "/generate",
                   json.dumps({"text": "", "sampling_params": {"max_new_tokens": 2}}).encode()),
        BadRequest("generate: empty prompt in a batch", "/generate",
                   json.dumps({"text": ["x", ""], "sampling_params": {"max_new_tokens": 2}}).encode()),
        BadRequest("wrong method", chat, b"", content_type=None, expect=(405,), method="GET"),
    ]


def oversized_body(model: str, size: int) -> bytes:
    filler = b"a " * (size // 2 + 1)
    return (b'{"model": "' + model.encode() + b'", "max_tokens": 4, "messages": [{"role": "user", "content": "'
            + filler + b'"}]}')


def error_shape_problem(status: int, body: bytes) -> str | None:
    """Why `body` is not an OpenAI-style error ({"error": {"message", "type", "param", "code"}}); None if it is."""
    try:
        data = json.loads(body)
    except ValueError:
        return f"not JSON: {body[:200]!r}"
    err = data.get("error") if isinstance(data, dict) else None
    if not isinstance(err, dict):
        return f"no error object: {body[:200]!r}"
    missing = {"message", "type", "param", "code"} - set(err)
    if missing:
        return f"error object lacks {sorted(missing)}: {body[:200]!r}"
    if not isinstance(err["message"], str) or not err["message"]:
        return f"empty message: {body[:200]!r}"
    if 'File "' in err["message"]:
        return f"message names server files: {err['message'][:200]!r}"
    return None


def send(url: str, method: str, path: str, body: bytes | None, headers: dict[str, str] | None = None,
         timeout: float = 120) -> tuple[int, bytes]:
    req = urllib.request.Request(url + path, data=body if method != "GET" else None, method=method,
                                 headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def send_bad(url: str, bad: BadRequest, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    h = dict(headers or {})
    if bad.content_type:
        h["Content-Type"] = bad.content_type
    return send(url, bad.method, bad.path, bad.body, h)


# ---------------------------------------------------------------------------------------------- server state

IDLE_GAUGES = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:num_used_tokens", "sglang:token_usage")


def live_load(url: str, headers: dict[str, str] | None = None) -> dict:
    """The scheduler's own view now (`/v1/loads`), not a gauge that was published some time ago."""
    req = urllib.request.Request(f"{url}/v1/loads", headers=headers or {})
    with urllib.request.urlopen(req, timeout=30) as r:
        loads = json.load(r)["loads"]
    keys = ("num_running_reqs", "num_waiting_reqs", "num_used_tokens", "token_usage")
    return {k: sum(float(entry.get(k) or 0) for entry in loads) for k in keys}


def metric_gauges(url: str) -> dict[str, float | None]:
    snap = server_metrics.scrape(url)
    return {name: server_metrics.total(snap, name) for name in IDLE_GAUGES}


def is_idle(url: str, headers: dict[str, str] | None = None) -> tuple[bool, dict]:
    """Nothing running or queued and no KV cache held by requests -- live and in the exported gauges."""
    live, gauges = live_load(url, headers), metric_gauges(url)
    idle = all(v == 0 for v in live.values()) and all((v or 0) == 0 for v in gauges.values())
    return idle, {"live": live, "metrics": gauges}


def wait_idle(url: str, headers: dict[str, str] | None = None, timeout: float = 5.0,
              poll: float = 0.25) -> tuple[bool, float, dict]:
    """(idle, seconds it took, last state)."""
    start = time.monotonic()
    while True:
        idle, state = is_idle(url, headers)
        elapsed = time.monotonic() - start
        if idle or elapsed > timeout:
            return idle, elapsed, state
        time.sleep(poll)
