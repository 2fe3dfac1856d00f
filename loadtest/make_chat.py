"""Build loadtest/prompts/chat.jsonl: general-assistant chat requests of about 256 prompt tokens, sampled.

    python -m loadtest.make_chat [--out loadtest/prompts/chat.jsonl] [--tokens 256]

Why: a general chat model's traffic is a system prompt, an earlier exchange and a new question -- a few hundred
prompt tokens, prose, sampled at temperature 1 -- not the bare one-line prompts of prompts/prose.jsonl. At that
prompt length the prefill and the drafter's prompt context weigh on the first token as they do in production chat.
Each line: a system prompt, one earlier user/assistant exchange and a new question (the one-line questions of
prompts/prose.jsonl), then the earlier answer trimmed or extended by whole sentences until the chat-templated
prompt is within 10 % of ``--tokens`` under the bundled pair's tokenizer. ``temperature`` 1 on every line.
tests/unit/test_loadtest_prompts.py checks the committed file is what this script writes.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from loadtest.make_mixed import render  # noqa: F401  (one JSONL writer for the generated prompt sets)

PROMPTS = Path(__file__).resolve().parent / "prompts"
OUT = PROMPTS / "chat.jsonl"
TOKENIZER = Path(__file__).resolve().parents[1] / "models" / "tiny-code" / "target"
TEMPERATURE = 1.0
LINES = 64
SHORT = 48  # prompt tokens of a one-line question

SYSTEM = ("You are a helpful, friendly assistant for a small community library. Answer in clear, warm prose. "
          "Keep answers focused on the question, avoid lists unless asked, and never invent facts about the "
          "library's opening hours, events or staff. If a question is outside what you know, say so briefly and "
          "suggest asking at the front desk.")

# sentences the earlier answers are made of, in order; each answer starts at its own offset
SENTENCES = [
    "That is a lovely question, and there are a few ways to think about it.",
    "Many readers find that the first chapters set the mood more than the plot does.",
    "The weather that week had been grey and quiet, which suited the reading room well.",
    "A good story often begins with a small change in an ordinary day.",
    "Some people prefer to read slowly, a few pages each evening, and let the book settle.",
    "Others like to finish a novel in one long afternoon with a pot of tea beside them.",
    "The old map in the hallway shows the town as it was a hundred years ago.",
    "Children's books are on the ground floor, next to the garden window.",
    "If you enjoy poetry, the anthologies on the second shelf are a gentle place to start.",
    "Letters and diaries can feel more personal than any novel, because nobody wrote them for us.",
    "The river walk behind the library is pleasant in every season, even in the rain.",
    "When a character makes a difficult choice, the story usually shows us what they value.",
    "Most of the volunteers started as regular visitors who simply stayed a little longer.",
    "Writing by hand slows your thoughts down, and sometimes that is exactly what helps.",
    "Travel writing works best when the author notices small details, like the smell of bread at dawn.",
    "History books can be surprisingly funny when they quote what people actually said.",
]


def _rows(name: str) -> list[dict]:
    return [json.loads(x) for x in (PROMPTS / name).read_text().splitlines() if x.strip()]


def build(tokens: int = 256, lines: int = LINES) -> list[dict]:
    """The lines of chat.jsonl (module docstring)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    count = lambda text: len(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    # the one-line questions (the file's longer prompts carry a passage of their own)
    questions = [q for q in (r["messages"][-1]["content"] for r in _rows("prose.jsonl")) if count(q) <= SHORT]
    out = []
    for i in range(lines):
        q, rnd = len(questions), i // len(questions)  # every round pairs each question with another one
        first, last = questions[i % q], questions[(i + 1 + rnd) % q]
        offset = i + 5 * rnd
        best = None
        for n in range(1, 4 * len(SENTENCES)):
            answer = " ".join(SENTENCES[(offset + j) % len(SENTENCES)] for j in range(n))
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": first},
                        {"role": "assistant", "content": answer}, {"role": "user", "content": last}]
            text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            length = count(text)
            if best is None or abs(length - tokens) < abs(best[0] - tokens):
                best = (length, messages)
            if length >= tokens:
                break
        if abs(best[0] - tokens) > 0.1 * tokens:
            raise ValueError(f"line {i}: {best[0]} prompt tokens, not within 10 % of {tokens}")
        out.append({"messages": best[1], "category": "chat", "temperature": TEMPERATURE})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--tokens", type=int, default=256, help="prompt tokens per request (within 10 %%)")
    a = p.parse_args(argv)
    rows = build(a.tokens)
    a.out.write_text(render(rows))
    print(f"{len(rows)} chat requests of ~{a.tokens} prompt tokens at temperature {TEMPERATURE:g} -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
