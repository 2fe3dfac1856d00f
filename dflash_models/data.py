"""Training data for the bundled pair: tokenizer, token streams and prompts, all from the stdlib corpus.

Everything is a pure function of the corpus files and a seed, so a rebuild on the same Python
version sees the same data. Two kinds of text are made from each source file:

- plain code, the file itself (documents separated by `<|endoftext|>`);
- chat turns in the tokenizer's ChatML template: a user message holding a few lines of the
  file and an assistant reply holding the lines that follow, so the target also answers
  `/v1/chat/completions` with code.
"""
from __future__ import annotations

import random
import zlib
from dataclasses import dataclass
from pathlib import Path

from dflash_models import corpus
from dflash_models.tokenizer import ENDOFTEXT, IM_END, IM_START, train_tokenizer


def chat_prompt(user: str) -> str:
    """ChatML text up to the opened assistant turn (what the chat template renders)."""
    return f"{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n"


def chat_text(user: str, assistant: str) -> str:
    return chat_prompt(user) + f"{assistant}{IM_END}\n"


def _file_rng(seed: int, path: Path) -> random.Random:
    return random.Random(seed * 1_000_003 + zlib.crc32(path.name.encode()) + len(path.parts))


def chat_pairs(path: Path, seed: int, per_lines: int = 120) -> list[tuple[str, str]]:
    """(user, assistant) pairs cut from one file: a few lines, then the lines that follow."""
    lines = corpus.read_text(path).splitlines(keepends=True)
    rng = _file_rng(seed, path)
    pairs = []
    for _ in range(max(1, len(lines) // per_lines)):
        if len(lines) < 8:
            break
        start = rng.randrange(0, len(lines) - 4)
        n_user, n_reply = rng.randint(1, 6), rng.randint(3, 20)
        user = "".join(lines[start:start + n_user]).rstrip("\n")
        reply = "".join(lines[start + n_user:start + n_user + n_reply]).rstrip("\n")
        if user.strip() and reply.strip():
            pairs.append((user, reply))
    return pairs


def build_tokenizer(out_dir: str | Path, vocab_size: int = 4096, files: list[Path] | None = None):
    """Byte-level BPE trained on the training split (held-out files never seen)."""
    files = files if files is not None else corpus.split_files(corpus.stdlib_files()).train
    return train_tokenizer((corpus.read_text(f) for f in files), vocab_size, out_dir)


def token_stream(tokenizer, files: list[Path], seed: int, chat: bool = True) -> list[int]:
    """Flat token ids: every file as plain code, then (if `chat`) its chat pairs; documents end
    with `<|endoftext|>`."""
    eot = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    docs = [corpus.read_text(f) for f in files]
    if chat:
        docs += [chat_text(u, a) for f in files for u, a in chat_pairs(f, seed)]
    ids: list[int] = []
    for enc in tokenizer(docs, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eot)
    return ids


@dataclass(frozen=True)
class Prompt:
    text: str
    kind: str  # "code" or "chat"


def prompts(files: list[Path], n: int, seed: int, chat_fraction: float = 0.5,
            min_lines: int = 2, max_lines: int = 12) -> list[Prompt]:
    """`n` prompts cut from `files`: code prefixes (a window of lines, for plain completion) and
    chat prompts (a few lines as the user message). Deterministic in (files, n, seed)."""
    rng = random.Random(seed)
    texts = [corpus.read_text(f).splitlines(keepends=True) for f in files]
    texts = [t for t in texts if len(t) > max_lines + 4]
    out: list[Prompt] = []
    while len(out) < n:
        lines = rng.choice(texts)
        start = rng.randrange(0, len(lines) - max_lines - 1)
        k = rng.randint(min_lines, max_lines)
        body = "".join(lines[start:start + k])
        if not body.strip():
            continue
        if rng.random() < chat_fraction:
            out.append(Prompt(chat_prompt(body.rstrip("\n")), "chat"))
        else:
            out.append(Prompt(body, "code"))
    return out
