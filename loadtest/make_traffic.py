"""Build chat-service-shaped prompt sets: multi-turn chats on one system prompt, long prompts, a length mix.

    python -m loadtest.make_traffic [--out-dir loadtest/prompts]

Why: a general chat model's traffic is not one-line prompts. Three sets, generated here from the repository's own
prompt sets (no download), each a JSONL file the load test and the sweep read like the others:

- ``multiturn.jsonl``: 32 conversations of 1 to 4 user turns on one shared system prompt of ~640 tokens (a
  support assistant's rules; ~660-1,100 prompt tokens a request). A conversation of k turns gives k lines, each
  the conversation so far ending on a user turn: every request shares the system prompt with every other, and a
  later turn shares its whole earlier conversation with the line before it -- SGLang's prefix cache (the radix
  tree) hits as it does on a chat service. Questions: support questions, the one-line prose questions and the
  chat and code questions of ``mix.jsonl``; earlier answers: sentences of ``make_chat``. No temperature of its
  own (the sweep's workload: 1).
- ``long.jsonl``: 24 requests of ~1,300-2,300 prompt tokens: a document pasted into the chat (prose passages of
  ``prose.jsonl`` and sentences of ``make_chat``, or code of ``mix.jsonl``), then an ask about it (summarise,
  review, continue). Prefill-heavy: the first token waits for the whole prompt.
- ``lengthmix.jsonl``: 64 requests whose prompt and answer lengths vary as a chat service's do, drawn 60/30/10:
  short questions (one line; 42 lines), medium (~330-540 tokens: a passage and an ask; 16) and long
  (~1,400-1,650 tokens; 6). Each line carries its own ``max_tokens`` (32, 128 or 256: short answers, paragraphs,
  essays), which loadtest/chat.py sends instead of ``--max-tokens``.

Token counts are under the bundled pair's tokenizer; tests/unit/test_loadtest_prompts.py checks the committed
files are what this script writes.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from loadtest.make_chat import SENTENCES
from loadtest.make_mixed import render

PROMPTS = Path(__file__).resolve().parent / "prompts"
FILES = ("multiturn.jsonl", "long.jsonl", "lengthmix.jsonl")

SYSTEM = " ".join([
    "You are the support assistant of Northwind Outfitters, an online shop for hiking and camping gear.",
    "Follow these rules in every answer.",
    "1. Be friendly, concise and concrete; answer the question that was asked before offering anything else.",
    "2. Orders: customers can change or cancel an order until it ships, usually within one business day. After "
    "that, they must wait for the parcel and return it. Never promise a delivery date; quote the carrier's "
    "estimate from the order page instead.",
    "3. Returns: unused items can be returned within 60 days with the original tags; used items only when "
    "faulty. Refunds go back to the original payment method within five to ten business days of the return "
    "arriving at the warehouse. Return shipping is free for faulty items and costs a flat fee otherwise.",
    "4. Warranty: tents, backpacks and sleeping bags carry a two-year warranty against manufacturing faults; "
    "wear and tear, accidents and damage from misuse are not covered. Ask for photos of the fault and the "
    "order number before suggesting a replacement.",
    "5. Sizing: recommend the size chart on each product page; for boots, suggest half a size up for long "
    "hikes with thick socks. Never guess a size from a height or weight alone.",
    "6. Safety: for questions about routes, weather or first aid, give general guidance only and recommend "
    "local mountain rescue, park rangers or a doctor for anything specific or urgent.",
    "7. Privacy: never ask for full card numbers or passwords. An order number and the email address on the "
    "order are enough to look an order up.",
    "8. Tone: no sales pressure. If a cheaper item does the job, say so. If you do not know, say so and offer "
    "to pass the question to a human colleague, who answers within one business day.",
    "9. Format: plain prose; use a short list only for steps the customer must follow in order.",
    "10. Language: answer in the language of the customer's message.",
])

SUPPORT_QUESTIONS = [
    "Can I still change the size of the boots I ordered this morning?",
    "My tent pole snapped on the second night. What can I do?",
    "How long does a refund take to show up on my card?",
    "Which sleeping bag would you recommend for spring camping in the hills?",
    "Do you ship to Norway, and how long does it usually take?",
    "The zip on my backpack broke after a year. Is that covered?",
    "I returned a jacket two weeks ago and have not heard anything. Can you check?",
    "What should I pack for a three-day hut-to-hut hike?",
]
FOLLOW_UPS = [
    "Thanks. And if it has already shipped?",
    "Could you explain that more simply?",
    "What do you need from me to get started?",
    "Is there anything cheaper that would do the same job?",
    "How would that work if I paid with a gift card?",
    "Can you summarise the steps for me?",
]
ASKS = ["Summarise the text above in one paragraph.", "What is the main point of the text above, and is it "
        "convincing?", "Continue the text above in the same style.", "Review the code above: what does it do, "
        "and what would you change?", "List the three most important details of the text above."]


def _rows(name: str) -> list[dict]:
    return [json.loads(x) for x in (PROMPTS / name).read_text().splitlines() if x.strip()]


def _sources() -> tuple[list[str], list[str], list[str]]:
    """(one-line questions, longer prose passages, code snippets) of the committed prompt sets."""
    prose = [r["messages"][-1]["content"] for r in _rows("prose.jsonl")]
    mix = _rows("mix.jsonl")
    code = [r["messages"][-1]["content"] for r in mix if r.get("category") == "code"]
    chat = [r["messages"][-1]["content"] for r in mix if r.get("category") == "chat"]
    short = [q for q in prose if len(q) < 200] + chat
    passages = [q for q in prose if len(q) >= 200]
    return short, passages, code


def _answer(rng: random.Random, n: int) -> str:
    start = rng.randrange(len(SENTENCES))
    return " ".join(SENTENCES[(start + j) % len(SENTENCES)] for j in range(n))


def _document(rng: random.Random, chars: int, passages: list[str], code: list[str], kind: str) -> str:
    """About `chars` characters of prose (passages and sentences) or code, deterministic for `rng`."""
    parts: list[str] = []
    while sum(len(p) + 2 for p in parts) < chars:
        if kind == "code":
            parts.append(rng.choice(code))
        else:
            parts.append(rng.choice(passages) if rng.random() < 0.5 else _answer(rng, rng.randint(3, 6)))
    return "\n\n".join(parts)


def multiturn(conversations: int = 32) -> list[dict]:
    rng = random.Random(1)
    short, _, code = _sources()
    openers = SUPPORT_QUESTIONS + short + code[:8]
    out = []
    for c in range(conversations):
        turns = 1 + c % 4
        messages = [{"role": "system", "content": SYSTEM}]
        for t in range(turns):
            question = openers[(c * 3) % len(openers)] if t == 0 else FOLLOW_UPS[(c + t) % len(FOLLOW_UPS)]
            messages.append({"role": "user", "content": question})
            out.append({"messages": list(messages), "category": f"chat-turn-{t + 1}", "conversation": c + 1})
            messages.append({"role": "assistant", "content": _answer(rng, rng.randint(2, 5))})
    return out


def long(lines: int = 24) -> list[dict]:
    rng = random.Random(2)
    _, passages, code = _sources()
    out = []
    for i in range(lines):
        kind = "code" if i % 3 == 2 else "prose"
        ask = ASKS[3] if kind == "code" else ASKS[i % 5 if i % 5 != 3 else 0]
        doc = _document(rng, rng.randint(4000, 6500), passages, code, kind)
        out.append({"messages": [{"role": "user", "content": f"{doc}\n\n{ask}"}], "category": f"long-{kind}"})
    return out


def lengthmix(lines: int = 64) -> list[dict]:
    rng = random.Random(3)
    short, passages, code = _sources()
    out = []
    for i in range(lines):
        draw = rng.random()
        if draw < 0.6:
            content, kind = rng.choice(short + SUPPORT_QUESTIONS), "short"
        elif draw < 0.9:
            content, kind = f"{_document(rng, 800, passages, code, 'prose')}\n\n{rng.choice(ASKS[:3])}", "medium"
        else:
            content, kind = f"{_document(rng, 4000, passages, code, 'prose')}\n\n{ASKS[0]}", "long"
        max_tokens = rng.choice((32, 128, 128, 256))
        out.append({"messages": [{"role": "user", "content": content}], "category": f"length-{kind}",
                    "max_tokens": max_tokens})
    return out


def build() -> dict[str, list[dict]]:
    """File name -> its lines (module docstring)."""
    return {"multiturn.jsonl": multiturn(), "long.jsonl": long(), "lengthmix.jsonl": lengthmix()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", type=Path, default=PROMPTS)
    a = p.parse_args(argv)
    for name, rows in build().items():
        (a.out_dir / name).write_text(render(rows))
        print(f"{len(rows)} requests -> {a.out_dir / name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
