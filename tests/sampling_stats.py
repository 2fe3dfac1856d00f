"""The test statistic of the sampling-losslessness tests, shared by the power calculation
(tests/unit/test_sampling_power.py) and the server tests (tests/integration/test_sampling_distribution.py).

A sample is the joint of a request's first three generated tokens. At temperature 1 the bundled target is too flat
for the raw joint to be compared cell by cell (800 samples of a prose prompt gave 797 distinct triples), so each
position is coarsened first: a token among the TOP_PER_POSITION most frequent at that position in the pooled
sample stays itself, any other becomes OTHER. The coarsened triples of two samples (plain decoding, speculative)
are compared with Pearson's chi-square test of homogeneity on a 2 x K table: every coarsened triple seen at least
MIN_CELL times in the pooled sample is a cell, the rest are pooled into one. Reject at ALPHA. The coarsening is a
fixed function of the pooled sample, symmetric in the two arms, so equal distributions stay equal.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from scipy.stats import chi2_contingency

ALPHA = 0.001
MIN_CELL = 5
N_PER_ARM = 800
TOP_PER_POSITION = 4
OTHER = -1


def coarsen(a: Sequence[tuple], b: Sequence[tuple]) -> tuple[list[tuple], list[tuple]]:
    pooled = list(a) + list(b)
    width = len(pooled[0]) if pooled else 0
    keep = [{t for t, _ in Counter(s[i] for s in pooled).most_common(TOP_PER_POSITION)} for i in range(width)]

    def f(s: tuple) -> tuple:
        return tuple(t if t in keep[i] else OTHER for i, t in enumerate(s))

    return [f(s) for s in a], [f(s) for s in b]


def informative_mass(a: Sequence[tuple], b: Sequence[tuple]) -> float:
    """The informative mass of the comparison: the fraction of the pooled sample in cells the test resolves
    (seen at least MIN_CELL times) that keep at least one token (not all OTHER)."""
    ca, cb = coarsen(a, b)
    pooled = Counter(ca + cb)
    informative = sum(n for k, n in pooled.items() if n >= MIN_CELL and any(t != OTHER for t in k))
    return informative / max(1, len(ca) + len(cb))


def homogeneity_pvalue(a: Sequence[tuple], b: Sequence[tuple]) -> float:
    a, b = coarsen(a, b)
    ca, cb = Counter(a), Counter(b)
    pooled = ca + cb
    cells = [k for k, n in pooled.items() if n >= MIN_CELL]
    rest_a = len(a) - sum(ca[k] for k in cells)
    rest_b = len(b) - sum(cb[k] for k in cells)
    table = [[ca[k] for k in cells], [cb[k] for k in cells]]
    if rest_a + rest_b > 0:
        table[0].append(rest_a)
        table[1].append(rest_b)
    if len(table[0]) < 2:
        return 1.0  # one outcome only: nothing to tell apart
    return float(chi2_contingency(table, correction=False).pvalue)


def min_p_violations(scorer_url: str, prompt_ids: list[int], output_ids: list[int], min_p: float) -> int:
    """How many of `output_ids` (sampled after `prompt_ids`) a min_p filter forbids: tokens whose probability under
    the target, as `scorer_url` (a plain-decoding server of the same target) scores the continuation, is below
    min_p x the most likely token's. Temperature 1: min_p acts on the unscaled distribution."""
    import math

    from harness.server import http_json

    body = {"input_ids": prompt_ids + output_ids, "return_logprob": True, "top_logprobs_num": 1,
            "logprob_start_len": len(prompt_ids) - 1, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    meta = http_json(f"{scorer_url}/generate", body, timeout=300)["meta_info"]
    chosen = meta["input_token_logprobs"][1:]  # [logprob, token id, text] of each output token
    best = meta["input_top_logprobs"][1:]      # the top token of the distribution that predicted it
    assert [c[1] for c in chosen] == output_ids, "the scorer did not score the sampled continuation"
    return sum(c[0] < top[0][0] + math.log(min_p) - 1e-4 for c, top in zip(chosen, best))
