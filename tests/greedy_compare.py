"""Greedy identity of speculative outputs against plain decoding's, over the full outputs.

float32 (``strict``): every output equals plain decoding's, token for token.

bfloat16: a width-b verify and a 1-token decode run different kernels, so a near-tie may flip late and the two
continuations part from there. What is still required: every speculative output has plain decoding's length (an
empty, truncated or overlong output fails, whatever its prefix), agrees with it on at least its first MIN_AGREED
tokens (the whole output when shorter), and at least MIN_IDENTICAL of the outputs equal plain decoding's in full --
a verify that is merely close would part early or often.
"""
from __future__ import annotations

from collections.abc import Sequence

MIN_AGREED = 32
MIN_IDENTICAL = 0.5


def first_difference(base: Sequence[int], spec: Sequence[int]) -> int | None:
    """The first index where the two outputs differ (a length difference counts), None when equal."""
    same = next((i for i, (x, y) in enumerate(zip(base, spec)) if x != y), min(len(base), len(spec)))
    return None if same == len(base) == len(spec) else same


def greedy_mismatches(base: Sequence[Sequence[int]], spec: Sequence[Sequence[int]], strict: bool) -> list[str]:
    """What breaks the greedy identity of ``spec`` (speculative outputs) with ``base`` (plain decoding's), pairwise;
    empty when it holds."""
    if len(base) != len(spec):
        return [f"{len(spec)} speculative outputs for {len(base)} plain ones"]
    problems, identical = [], 0
    for i, (b, s) in enumerate(zip(base, spec)):
        at = first_difference(b, s)
        if at is None:
            identical += 1
            continue
        if strict:
            problems.append(f"output {i}: differs at token {at} of {len(b)}")
        elif len(s) != len(b):
            problems.append(f"output {i}: {len(s)} tokens, plain decoding gave {len(b)}")
        elif at < min(MIN_AGREED, len(b)):
            problems.append(f"output {i}: differs at token {at}, before {MIN_AGREED}")
    if not strict and base and identical < MIN_IDENTICAL * len(base):
        problems.append(f"only {identical} of {len(base)} outputs equal plain decoding's in full")
    return problems


def assert_same_greedy(base: Sequence[Sequence[int]], spec: Sequence[Sequence[int]], strict: bool) -> None:
    problems = greedy_mismatches(base, spec, strict)
    assert not problems, "; ".join(problems)
