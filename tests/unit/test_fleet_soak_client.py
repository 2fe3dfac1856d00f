"""The fleet soak's client (loadtest/fleet_soak.py) retries, as real clients do, a request that got no response on a
keep-alive connection the server had already closed -- and only that: a server that drops every request still
fails the request.

The server here is a socket-level stand-in: sglang-router closes a keep-alive connection after answering a body it
did not read (a wrong or missing Content-Type), and a request meets that close only when it is sent before the FIN
arrives, which a test cannot time. The stand-in does what the client then sees, every time: it answers the first
request on a connection, keep-alive, and closes the connection when the next one arrives, without a response.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from loadtest import faults
from loadtest.fleet_soak import Outcome, bad, normal

STREAM = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in (
    {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "stop"}]},
    {"choices": [], "usage": {"completion_tokens": 1}})) + b"data: [DONE]\n\n"


class ClosingServer:
    """Answers `answered` requests per connection (400 for a request with `bad` in its path, else an SSE stream),
    then closes the connection on the next request without a response."""

    def __init__(self, answered: int):
        self.answered, self.connections, self.server = answered, 0, None

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            for served in range(self.answered + 1):
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                await reader.readexactly(length)
                if served == self.answered:
                    break  # the request was read and gets no answer: the close it meets
                if b" /bad" in head.split(b"\r\n", 1)[0]:
                    status, ctype, body = b"400 Bad Request", b"application/json", b'{"error": {}}'
                else:
                    status, ctype, body = b"200 OK", b"text/event-stream", STREAM
                writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: " + ctype + b"\r\nContent-Length: "
                             + str(len(body)).encode() + b"\r\n\r\n" + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


def client() -> httpx.AsyncClient:  # the soak's pool
    return httpx.AsyncClient(timeout=10, limits=httpx.Limits(max_connections=2, max_keepalive_connections=1))


BAD = faults.BadRequest("wrong content type", "/bad", b"{}", content_type="text/plain")


@pytest.mark.parametrize("then", ["normal", "bad"])
def test_a_request_on_a_connection_closed_after_the_previous_answer_is_retried_once_on_a_new_one(then):
    server = ClosingServer(answered=1)

    async def run():
        async with server as url, client() as c:
            first, second = Outcome("bad", 0.0), Outcome(then, 0.0)
            await bad(c, url, {}, BAD, first)
            if then == "normal":
                await normal(c, url, {}, "m", [{"role": "user", "content": "hi"}], 1, second)
            else:
                await bad(c, url, {}, BAD, second)
            return first, second

    first, second = asyncio.run(run())
    assert (first.result, first.status, first.retried) == ("ok", 400, "")
    assert second.result == "ok", second.what
    assert "Server disconnected without sending a response" in second.retried
    assert server.connections == 2  # the retry went out on a new connection


def test_a_server_that_never_answers_still_fails_the_request():
    async def run():
        async with ClosingServer(answered=0) as url, client() as c:
            o = Outcome("normal", 0.0)
            await normal(c, url, {}, "m", [{"role": "user", "content": "hi"}], 1, o)
            return o

    o = asyncio.run(run())
    assert o.result == "failed" and o.status is None, o
    assert "Server disconnected" in o.what and "Server disconnected" in o.retried
