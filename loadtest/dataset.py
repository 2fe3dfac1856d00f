"""Prompt sets for the load test: JSONL, one conversation per line, OpenAI or ShareGPT format."""
from __future__ import annotations

import json
from pathlib import Path

BUNDLED = Path(__file__).resolve().parent / "prompts" / "mix.jsonl"

_FORMATS = ('expected one JSON object per line, either OpenAI {"messages": [{"role": "user", "content": "..."}]} '
            'or ShareGPT {"conversations": [{"from": "human", "value": "..."}]}')
_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system"}
_OPENAI_ROLES = ("system", "developer", "user", "assistant", "tool")

Messages = list[dict[str, str]]


class DatasetError(ValueError):
    """A dataset line that is not a usable conversation; the message names the file and line."""


def load_prompts(path: str | Path | None = None) -> list[Messages]:
    """All conversations in `path` (default: the bundled code/math/chat mix), each ready to send as `messages`.

    OpenAI lines are sent as written, minus trailing assistant turns (a dataset's reference answers). ShareGPT
    lines are reduced to their first human turn (and a leading system turn), the convention of vLLM's and
    SGLang's benchmark scripts: whole multi-turn ShareGPT chats overflow small context windows.
    """
    path = Path(path) if path is not None else BUNDLED
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise DatasetError(f"{path}: cannot read the dataset ({e.strerror}); pass an existing JSONL file") from None
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: not UTF-8 text ({e.reason}); {_FORMATS}") from None
    prompts = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            prompts.append(parse_line(line))
        except DatasetError as e:
            raise DatasetError(f"{path}:{lineno}: {e}") from None
    if not prompts:
        raise DatasetError(f"{path}: no conversations in the file; {_FORMATS}")
    return prompts


def parse_line(line: str) -> Messages:
    """One JSONL line -> chat messages; DatasetError (without the location) when it is not usable."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise DatasetError(f"not JSON ({e.msg} at column {e.colno}); {_FORMATS}") from None
    if not isinstance(obj, dict):
        raise DatasetError(f"a JSON {type(obj).__name__}, not an object; {_FORMATS}")
    if "messages" in obj:
        return _openai(obj["messages"])
    if "conversations" in obj:
        return _sharegpt(obj["conversations"])
    raise DatasetError(f"neither 'messages' nor 'conversations' key (found {sorted(obj)[:5]}); {_FORMATS}")


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
