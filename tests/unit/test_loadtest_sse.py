"""The load test's SSE parsing and timing: what a chat-completions stream must look like to count as a success."""
from __future__ import annotations

import json

import pytest

from loadtest.sse import ChatStreamParser, StreamError


def chunk(content=None, role=None, reasoning=None, usage=None, finish=None) -> str:
    delta = {k: v for k, v in (("role", role), ("content", content), ("reasoning_content", reasoning))
             if v is not None}
    choices = [] if usage is not None and content is None else [
        {"index": 0, "delta": delta, "finish_reason": finish}]
    return "data: " + json.dumps({"object": "chat.completion.chunk", "choices": choices, "usage": usage})


USAGE = {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}


def feed(events: list[tuple[float, str]], start: float = 0.0, end: float | None = None):
    """Each event is sent like SGLang does: `data: ...` then a blank line, as bytes."""
    p = ChatStreamParser(start)
    for t, line in events:
        p.feed(line.encode(), t)
        p.feed(b"", t)
    return p.finish(end if end is not None else events[-1][0])


def sglang_like(times=(0.10, 0.15, 0.25, 0.30)) -> list[tuple[float, str]]:
    return [(0.05, chunk(role="assistant", content="")),          # role chunk: no output yet
            (times[0], chunk(content="def")), (times[1], chunk(content=" add")),
            (times[2], chunk(content="(a, b)")), (times[3], chunk(content=":", finish="length")),
            (0.31, chunk(usage=USAGE)), (0.32, "data: [DONE]")]


def test_timings_of_a_complete_stream():
    t = feed(sglang_like())
    assert t.ttft == pytest.approx(0.10)                           # first non-empty content, not the role chunk
    assert t.itl == pytest.approx([0.05, 0.10, 0.05])              # gaps between content chunks
    assert t.e2e == pytest.approx(0.32)                            # at [DONE]
    assert t.output_tokens == 4                                    # from usage, not from the chunk count
    assert t.tpot == pytest.approx((0.32 - 0.10) / 3)
    assert t.text == "def add(a, b):"


def test_times_are_relative_to_the_request_start():
    t = feed([(10 + s, line) for s, line in sglang_like()], start=10.0)
    assert t.ttft == pytest.approx(0.10) and t.e2e == pytest.approx(0.32)


def test_multi_token_chunks_count_tokens_from_usage():
    usage = {**USAGE, "completion_tokens": 9}                      # a speculative step emitted several tokens
    t = feed([(0.1, chunk(content="abc")), (0.2, chunk(content="defgh")), (0.3, chunk(usage=usage)),
              (0.3, "data: [DONE]")])
    assert len(t.itl) == 1 and t.output_tokens == 9
    assert t.tpot == pytest.approx(0.2 / 8)


def test_single_token_answer_has_no_tpot():
    t = feed([(0.1, chunk(content="x")), (0.1, chunk(usage={**USAGE, "completion_tokens": 1})),
              (0.1, "data: [DONE]")])
    assert t.tpot is None and t.itl == []


def test_reasoning_content_is_output():
    t = feed([(0.1, chunk(reasoning="hmm")), (0.2, chunk(content="4")), (0.2, chunk(usage=USAGE)),
              (0.2, "data: [DONE]")])
    assert t.ttft == pytest.approx(0.1) and t.text == "hmm4"


def test_sse_framing_crlf_comments_and_multiline_data():
    p = ChatStreamParser(0.0)
    lines = [": keep-alive", "event: message", "id: 1",
             'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}],\r',   # CRLF line ending
             'data:"usage": null}',                  # one event over two data lines, no space after the colon
             "", chunk(usage=USAGE), "", "data: [DONE]"]   # no blank line after [DONE]: still done
    for line in lines:
        p.feed(line, 0.5)
    t = p.finish(0.6)
    assert t.text == "hi" and t.output_tokens == 4 and t.e2e == pytest.approx(0.6)


def test_an_immediate_end_of_text_is_an_empty_answer_not_a_failure():
    """Sampling can pick the end-of-text token first: no content, finish_reason stop -- a valid, empty answer whose
    first (and only) token arrived with the stop."""
    t = feed([(0.05, chunk(role="assistant", content="")), (0.12, chunk(content="", finish="stop")),
              (0.13, chunk(usage={"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6})),
              (0.14, "data: [DONE]")])
    assert t.text == "" and t.output_tokens == 1 and t.ttft == pytest.approx(0.12) and t.itl == []
    assert t.tpot is None


@pytest.mark.parametrize("events, message", [
    ([(0.1, chunk(content="x")), (0.1, chunk(usage=USAGE))], "without 'data: [DONE]'"),
    ([(0.1, chunk(role="assistant", content="")), (0.1, chunk(usage=USAGE)), (0.1, "data: [DONE]")],
     "empty output"),
    ([(0.1, chunk(content="x")), (0.1, "data: [DONE]")], "include_usage"),
    ([(0.1, "data: {not json")], "not JSON"),
    ([(0.1, "data: [1, 2]")], "not a JSON object"),
    ([(0.1, 'data: {"id": "x"}')], "no 'choices'"),
    ([(0.1, "<html>Bad Gateway</html>")], "unexpected line"),
    ([(0.1, 'data: {"error": {"message": "out of memory", "code": 500}}')], "out of memory"),
    ([(0.1, 'data: {"object": "error", "message": "context too long"}')], "context too long"),
    ([(0.1, chunk(content="x")), (0.1, chunk(usage=USAGE)), (0.1, "data: [DONE]"), (0.2, chunk(content="y"))],
     "after [DONE]"),
])
def test_a_bad_stream_fails_with_a_reason(events, message):
    with pytest.raises(StreamError, match=message.replace("[", r"\[").replace("]", r"\]")):
        feed(events)


def test_non_utf8_line_is_malformed():
    p = ChatStreamParser(0.0)
    with pytest.raises(StreamError, match="not UTF-8"):
        p.feed(b"data: \xff\xfe", 0.1)


def completion_chunk(text=None, usage=None, finish=None) -> str:
    """A /v1/completions stream chunk, as SGLang sends it (`choices[].text`; the usage chunk has no choices)."""
    choices = [] if usage is not None else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
    return "data: " + json.dumps({"object": "text_completion", "choices": choices, "usage": usage})


def test_a_completions_stream_is_timed_like_a_chat_stream():
    seen = []
    p = ChatStreamParser(0.0, on_text=seen.append)
    for t, line in [(0.1, completion_chunk("\n")), (0.2, completion_chunk("def f")), (0.25, completion_chunk("")),
                    (0.3, completion_chunk("(x):", finish="length")), (0.31, completion_chunk(usage=USAGE)),
                    (0.32, "data: [DONE]")]:
        p.feed(line, t)
        p.feed("", t)
    t = p.finish(0.32)
    assert (t.ttft, t.e2e, t.output_tokens, t.text) == (pytest.approx(0.1), pytest.approx(0.32), 4, "\ndef f(x):")
    assert t.itl == pytest.approx([0.1, 0.1])            # the empty chunk is no output
    assert seen == ["\n", "\ndef f", "\ndef f(x):"]        # the client hook: the whole text so far, per chunk


def test_a_truncated_completions_stream_fails():
    with pytest.raises(StreamError, match="without 'data: \\[DONE\\]'"):
        feed([(0.1, completion_chunk("def")), (0.2, completion_chunk(usage=USAGE))])
