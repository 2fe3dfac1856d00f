"""The operator's original mix: a JSONL file of prompts (`learning.dataset`), one request a line.

    {"prompt": "def parse(line):"}                                  a completion prompt, tokenized as written
    {"messages": [{"role": "user", "content": "Hello"}]}             a chat, rendered by the target's chat template

A chat's trailing assistant turns are dropped: the learner generates the target's own answer to what precedes them.
Every error names the field, the file and the line.
"""
from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

FIELD = "learning.dataset"


class DatasetError(ValueError):
    pass


def read(path: str | Path) -> list[dict]:
    """The file's requests: each {"prompt": str} or {"messages": [...]} (checked line by line)."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{FIELD}: {path} is not a file")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{FIELD}: {path} line {n}"
        try:
            row = json.loads(line)
        except ValueError as e:
            raise DatasetError(f"{where}: not JSON ({e})") from None
        if not isinstance(row, dict):
            raise DatasetError(f"{where}: expected an object with prompt or messages")
        if isinstance(row.get("prompt"), str) and row["prompt"]:
            out.append({"prompt": row["prompt"]})
            continue
        messages = row.get("messages")
        if not isinstance(messages, list) or not messages:
            raise DatasetError(f"{where}: needs a non-empty prompt (text) or messages (a list of role/content)")
        for m in messages:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DatasetError(f"{where}: messages: each needs a role and a content (text)")
        while messages and messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        if not messages:
            raise DatasetError(f"{where}: messages: nothing before the assistant's answer")
        out.append({"messages": [{"role": m["role"], "content": m["content"]} for m in messages]})
    if len(out) < 2:
        raise DatasetError(f"{FIELD}: {path} holds {len(out)} request(s); the learner needs at least 2 (one to "
                           f"train on, one to measure on)")
    return out


def digest(path: str | Path) -> str:
    """The file's identity for the learner's cache of the target's answers (a changed file is generated anew)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def encode(rows: list[dict], tokenizer, max_prompt_tokens: int) -> list[list[int]]:
    """Token ids of each request as the server would see it (chats through the target's chat template), the last
    `max_prompt_tokens` of a long one."""
    out = []
    for row in rows:
        if "prompt" in row:
            ids = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        else:
            text = tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        out.append(list(ids)[-max_prompt_tokens:])
    return out


def split(rows: list, n_train: int, n_eval: int, seed: int = 0) -> tuple[list, list]:
    """(train, eval): a fixed shuffle; eval takes up to half of the file (at most `n_eval`), train the rest (at most
    `n_train`). Never the same request in both."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    k = min(n_eval, len(rows) // 2)
    return [rows[i] for i in order[k:k + n_train]], [rows[i] for i in order[:k]]
