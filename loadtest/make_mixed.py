"""Build loadtest/prompts/mixed.jsonl: code and prose requests interleaved, each line with its own temperature.

    python -m loadtest.make_mixed [--out loadtest/prompts/mixed.jsonl]

Why: one server serves code and prose users at once, and a controller that learns from its traffic sees both in
the same batches. The `code` workload's code prompts (prompts/mix.jsonl, category code) decoded greedily alternate
with the `prose` workload's prompts (prompts/prose.jsonl) sampled at temperature 1, one for one, so every shuffle
of the file sends about as many of each. Each line carries its `temperature`, which loadtest/chat.py sends instead
of --temperature. The committed file is what the sweep's `mixed` workload sends; tests/unit/test_loadtest_prompts.py
checks it is what this script writes from the two sets.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

PROMPTS = Path(__file__).resolve().parent / "prompts"
OUT = PROMPTS / "mixed.jsonl"
CODE_TEMPERATURE, PROSE_TEMPERATURE = 0.0, 1.0


def build() -> list[dict]:
    """Lines of mixed.jsonl: code and prose alternating, as many code lines as there are prose lines."""
    rows = lambda name: [json.loads(x) for x in (PROMPTS / name).read_text().splitlines() if x.strip()]  # noqa: E731
    code = [r for r in rows("mix.jsonl") if r.get("category") == "code"]
    prose = rows("prose.jsonl")
    out = []
    for c, p in zip(code, prose):
        out += [c | {"temperature": CODE_TEMPERATURE}, p | {"temperature": PROSE_TEMPERATURE}]
    return out


def render(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args(argv)
    rows = build()
    a.out.write_text(render(rows))
    print(f"{len(rows)} requests (code at temperature {CODE_TEMPERATURE:g}, prose at {PROSE_TEMPERATURE:g}) -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
