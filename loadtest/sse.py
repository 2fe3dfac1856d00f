"""Parse an OpenAI chat-completions or completions SSE stream and time it (no Locust, no HTTP: fed line by line)."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field


class StreamError(Exception):
    """The stream is not a complete, well-formed (chat) completions stream; the message says what was wrong."""


@dataclass
class StreamTimings:
    """One streamed request. Times are seconds from the moment the request was sent."""

    ttft: float                      # first non-empty content delta
    e2e: float                       # [DONE] received
    output_tokens: int               # usage.completion_tokens of the final usage chunk
    itl: list[float] = field(default_factory=list)   # gaps between consecutive content chunks
    text: str = ""

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None for a one-token answer (no decode step to time)."""
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


_IGNORED_FIELDS = ("event", "id", "retry")


class ChatStreamParser:
    """Feed raw SSE lines (without their line terminator) with their arrival time, then call `finish()`.

    Reads both OpenAI streams: chat (`choices[].delta.content`, and `reasoning_content`) and completions
    (`choices[].text`). Strict on purpose: a load test that silently accepts a truncated or garbled stream reports
    latencies for answers nobody received. A chunk may carry several tokens (a speculative step emits all tokens
    it accepted at once), so ITL is per chunk and TPOT is per token. `on_text`, if given, is called with the whole
    text received so far after every chunk that carried some (what a client that re-reads its output does).
    """

    def __init__(self, start: float, on_text: Callable[[str], None] | None = None):
        self.start = start
        self._on_text = on_text
        self._data: list[str] = []       # data lines of the event being assembled
        self._done_at: float | None = None
        self._content_times: list[float] = []
        self._text: list[str] = []
        self._usage: dict | None = None
        self._stopped_at: float | None = None  # a choice's finish_reason "stop" arrived (end of text)
        self._events = 0

    def feed(self, line: bytes | str, now: float) -> None:
        if isinstance(line, bytes):
            try:
                line = line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise StreamError(f"malformed SSE: line is not UTF-8 ({e})") from None
        line = line.rstrip("\r")
        if not line:
            self._dispatch(now)
            return
        if line.startswith(":"):         # SSE comment (keep-alive)
            return
        name, sep, value = line.partition(":")
        if not sep or (name != "data" and name not in _IGNORED_FIELDS):
            raise StreamError(f"malformed SSE: unexpected line {line[:120]!r} (expected 'data: ...')")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)

    def finish(self, now: float) -> StreamTimings:
        """End of the HTTP body: validate and return the timings."""
        self._dispatch(now)              # a last event without its blank line still counts
        if self._done_at is None:
            raise StreamError(f"stream ended without 'data: [DONE]' after {self._events} events (truncated?)")
        if not self._content_times:
            if self._stopped_at is None:
                raise StreamError("empty output: no content in any chunk, and no finish_reason 'stop'")
            # the model's first token was its end of text (sampling allows it): an empty answer, received when the
            # stop arrived -- the request succeeded
            self._content_times.append(self._stopped_at)
        if self._usage is None or not isinstance(self._usage.get("completion_tokens"), int):
            raise StreamError("no usage chunk with completion_tokens: send stream_options={'include_usage': true} "
                              "to a server that honours it")
        times = self._content_times
        return StreamTimings(
            ttft=times[0] - self.start,
            e2e=self._done_at - self.start,
            output_tokens=self._usage["completion_tokens"],
            itl=[b - a for a, b in zip(times, times[1:])],
            text="".join(self._text),
        )

    def _dispatch(self, now: float) -> None:
        if not self._data:
            return
        data, self._data = "\n".join(self._data), []
        self._events += 1
        if self._done_at is not None:
            raise StreamError(f"malformed SSE: data after [DONE]: {data[:120]!r}")
        if data.strip() == "[DONE]":
            self._done_at = now
            return
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError as e:
            raise StreamError(f"malformed SSE: data is not JSON ({e.msg}): {data[:120]!r}") from None
        if not isinstance(chunk, dict):
            raise StreamError(f"malformed SSE: data is not a JSON object: {data[:120]!r}")
        if "error" in chunk or chunk.get("object") == "error":
            err = chunk.get("error", chunk)
            msg = err.get("message", err) if isinstance(err, dict) else err
            raise StreamError(f"server error in stream: {msg}")
        if "choices" not in chunk:
            raise StreamError(f"malformed chunk: no 'choices': {data[:120]!r}")
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        piece = "".join(_choice_text(c) for c in chunk["choices"] or [])
        if piece:
            self._content_times.append(now)
            self._text.append(piece)
            if self._on_text is not None:
                self._on_text("".join(self._text))
        if self._stopped_at is None and any(c.get("finish_reason") == "stop" for c in chunk["choices"] or []):
            self._stopped_at = now


def _choice_text(choice) -> str:
    """The text one streamed choice carries: a chat delta's, or a completion's `text`."""
    if not isinstance(choice, dict):
        raise StreamError(f"malformed chunk: a choice is not a JSON object: {json.dumps(choice)[:120]}")
    delta = choice.get("delta")
    if isinstance(delta, dict):
        # reasoning models stream their thinking first: it is output the user waits for, so it counts
        return "".join(delta.get(k) or "" for k in ("reasoning_content", "content"))
    text = choice.get("text")
    return text if isinstance(text, str) else ""
