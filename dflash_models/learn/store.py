"""Reading the capture store the servers write (sglang_ext/capture.py has the format: JSONL segments, one request a
line, {"t", "p": prompt ids, "o": output ids, "s": sampled}). A torn last line (a writer mid-append) is skipped."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SEGMENT_GLOB = "seg-*.jsonl"


@dataclass(frozen=True)
class Captured:
    t: float
    prompt: list[int]
    output: list[int]
    sampled: bool

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.output


def read(store_dir: str | Path, max_prompt_tokens: int = 192) -> list[Captured]:
    """Every captured request, oldest first; prompts cut to their last ``max_prompt_tokens`` ids (as the bundled
    pair's training data: the drafter learns responses, the context only conditions them)."""
    out: list[Captured] = []
    for seg in sorted(Path(store_dir).glob(SEGMENT_GLOB)):
        try:
            lines = seg.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:  # pruned while we read
            continue
        for line in lines:
            try:
                d = json.loads(line)
                out.append(Captured(float(d["t"]), list(d["p"])[-max_prompt_tokens:], list(d["o"]), bool(d["s"])))
            except (ValueError, KeyError, TypeError):
                continue
    out.sort(key=lambda c: c.t)
    return out


def split_recent(items: list[Captured], holdout_fraction: float) -> tuple[list[Captured], list[Captured]]:
    """(train, held out): the most recent ``holdout_fraction`` is held out for the gate, never trained on."""
    n_hold = max(1, int(round(len(items) * holdout_fraction)))
    return items[:-n_hold], items[-n_hold:]
