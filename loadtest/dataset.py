"""Prompt sets for the load test: JSONL, one request per line: a chat (OpenAI or ShareGPT) or a completion prompt."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

BUNDLED = Path(__file__).resolve().parent / "prompts" / "mix.jsonl"

_FORMATS = ('expected one JSON object per line: OpenAI chat {"messages": [{"role": "user", "content": "..."}]}, '
            'ShareGPT {"conversations": [{"from": "human", "value": "..."}]} or OpenAI completions '
            '{"prompt": "..."}, each with an optional "temperature": number >= 0 and "max_tokens": integer >= 1')
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system"}
_OPENAI_ROLES = ("system", "developer", "user", "assistant", "tool")

Messages = list[dict[str, str]]


class DatasetError(ValueError):
    """A dataset line that is not a usable request; the message names the file, the line and the field."""


@dataclass(frozen=True)
class Request:
    """One dataset line, ready to send: chat `messages` (to /v1/chat/completions) or a raw completion `prompt`
    (to /v1/completions: no chat template, as code-completion clients send), and the line's own `temperature`
    (None: the run's)."""

    line: int                              # 1-based line number in its file (what per-request records name)
    messages: Messages | None = None
    prompt: str | None = None
    temperature: float | None = None
    max_tokens: int | None = None          # the line's own answer budget (None: the run's --max-tokens)

    @property
    def endpoint(self) -> str:
        return "/v1/completions" if self.prompt is not None else "/v1/chat/completions"

    def payload(self) -> dict:
        """The body's prompt part: {"messages": ...} or {"prompt": ...}."""
        return {"prompt": self.prompt} if self.prompt is not None else {"messages": self.messages}


def load_requests(path: str | Path | None = None) -> list[Request]:
    """Every request of `path` (default: the bundled code/math/chat mix), chat and completion lines alike.

    OpenAI chat lines are sent as written, minus trailing assistant turns (a dataset's reference answers).
    ShareGPT lines are reduced to their first human turn (and a leading system turn), the convention of vLLM's
    and SGLang's benchmark scripts: whole multi-turn ShareGPT chats overflow small context windows.
    """
    path = Path(path) if path is not None else BUNDLED
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise DatasetError(f"{path}: cannot read the dataset ({e.strerror}); pass an existing JSONL file") from None
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: not UTF-8 text ({e.reason}); {_FORMATS}") from None
    requests = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            requests.append(parse_request(line, lineno))
        except DatasetError as e:
            raise DatasetError(f"{path}:{lineno}: {e}") from None
    if not requests:
        raise DatasetError(f"{path}: no requests in the file; {_FORMATS}")
    return requests


def load_prompts(path: str | Path | None = None) -> list[Messages]:
    """The conversations of a chat-only dataset, each ready to send as `messages`, for callers that send every
    prompt as a chat at one temperature of their own. A completion line or a line's own temperature is refused
    (it would be sent wrong or silently ignored); `load_requests` serves those."""
    out = []
    for r in load_requests(path):
        where = f"{Path(path) if path is not None else BUNDLED}:{r.line}"
        if r.messages is None:
            raise DatasetError(f"{where}: 'prompt' is a completion prompt, and this tool sends chat messages only; "
                               f"use a chat dataset (loadtest/chat.py and the sweep send both)")
        if r.temperature is not None:
            raise DatasetError(f"{where}: 'temperature' of its own, and this tool sends one temperature to every "
                               f"prompt; drop the field (loadtest/chat.py and the sweep honour it)")
        out.append(r.messages)
    return out


def parse_request(line: str, lineno: int = 0) -> Request:
    """One JSONL line -> a Request; DatasetError (without the location) when it is not usable."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DatasetError(f"not JSON ({e.msg} at column {e.colno}); {_FORMATS}") from None
    if not isinstance(obj, dict):
        raise DatasetError(f"a JSON {type(obj).__name__}, not an object; {_FORMATS}")
    temperature = obj.get("temperature")
    if temperature is not None and (not isinstance(temperature, (int, float)) or isinstance(temperature, bool)
                                    or temperature < 0):
        raise DatasetError(f"'temperature' must be a number >= 0 (or absent: the run's --temperature), "
                           f"got {json.dumps(temperature)[:80]}")
    temperature = None if temperature is None else float(temperature)
    max_tokens = obj.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        raise DatasetError(f"'max_tokens' must be an integer >= 1 (or absent: the run's --max-tokens), "
                           f"got {json.dumps(max_tokens)[:80]}")
    kinds = [k for k in ("messages", "conversations", "prompt") if k in obj]
    if len(kinds) > 1:
        raise DatasetError(f"both {kinds[0]!r} and {kinds[1]!r}: a line is one request; {_FORMATS}")
    if "messages" in obj:
        return Request(lineno, messages=_openai(obj["messages"]), temperature=temperature, max_tokens=max_tokens)
    if "conversations" in obj:
        return Request(lineno, messages=_sharegpt(obj["conversations"]), temperature=temperature,
                       max_tokens=max_tokens)
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise DatasetError(f"'prompt' must be a non-empty string (one completion prompt), "
                               f"got {json.dumps(obj['prompt'])[:80]}")
        return Request(lineno, prompt=obj["prompt"], temperature=temperature, max_tokens=max_tokens)
    raise DatasetError(f"none of 'messages', 'conversations' or 'prompt' (found {sorted(obj)[:5]}); {_FORMATS}")


def _openai(messages) -> Messages:
    if not isinstance(messages, list) or not messages:
        raise DatasetError("'messages' must be a non-empty list of {\"role\": ..., \"content\": ...}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _OPENAI_ROLES or not isinstance(m.get("content"), str):
            raise DatasetError(f"messages[{i}] must be {{\"role\": one of {list(_OPENAI_ROLES)}, "
                               f"\"content\": string}}, got {json.dumps(m)[:80]}")
        out.append({"role": m["role"], "content": m["content"]})
    while out and out[-1]["role"] == "assistant":
        out.pop()
    if not any(m["role"] == "user" for m in out):
        raise DatasetError("no user message to answer")
    return out


def _sharegpt(turns) -> Messages:
    if not isinstance(turns, list) or not turns:
        raise DatasetError("'conversations' must be a non-empty list of {\"from\": ..., \"value\": ...}")
    out: Messages = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict) or not isinstance(t.get("value"), str) or t.get("from") not in _SHAREGPT_ROLES:
            raise DatasetError(f"conversations[{i}] must be {{\"from\": \"human\"|\"gpt\"|\"system\", "
                               f"\"value\": string}}, got {json.dumps(t)[:80]}")
        role = _SHAREGPT_ROLES[t["from"]]
        if role == "system" and i == 0:
            out.append({"role": "system", "content": t["value"]})
        elif role == "user":
            out.append({"role": "user", "content": t["value"]})
            return out
    raise DatasetError("no human turn to answer")
