"""The test statistic of the sampling-losslessness tests, shared by the power calculation
(tests/unit/test_sampling_power.py) and the server tests (tests/integration/test_sampling_distribution.py).

A sample is the joint of a request's first three generated tokens. At temperature 1 the bundled target is too flat
for the raw joint to be compared cell by cell (800 samples of a prose prompt gave 797 distinct triples), so each
position is coarsened first: a token among the TOP_PER_POSITION most frequent at that position in the pooled
sample stays itself, any other becomes OTHER. The coarsened triples of two samples (plain decoding, speculative)
are compared with Pearson's chi-square test of homogeneity on a 2 x K table: every coarsened triple seen at least
MIN_CELL times in the pooled sample is a cell, the rest are pooled into one. Reject at ALPHA. The coarsening is a
fixed function of the pooled sample, symmetric in the two arms, so equal distributions stay equal.

A comparison that could not tell two distributions apart whatever they were is refused (UninformativeTest), not
passed: fewer than MIN_CELLS cells in its table, or less than MIN_MASS of the pooled sample in resolved cells that
keep a token (the rest is one pooled cell that says nothing about which tokens were drawn). ``marginal_pvalue`` is
the same test on single tokens (tests/integration/test_lossless.py: a position's marginal), with the same refusal.
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
MIN_CELLS = 2     # a table of one cell has no degrees of freedom
MIN_MASS = 0.05   # least share of the pooled sample in resolved, informative cells


class UninformativeTest(AssertionError):
    """The samples resolve too little to compare: a test that would pass whatever the distributions were."""


def _refuse_uninformative(cells: int, mass: float) -> None:
    if cells < MIN_CELLS:
        raise UninformativeTest(f"{cells} cell(s) in the table: nothing to tell apart (at least {MIN_CELLS})")
    if mass < MIN_MASS:
        raise UninformativeTest(f"informative mass {mass:.3f} below {MIN_MASS}: the resolved cells hold too little "
                                "of the samples to compare")


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
    """Pearson's chi-square p-value of the coarsened triples of `a` and `b`; UninformativeTest when the table has
    fewer than MIN_CELLS cells or an informative mass below MIN_MASS."""
    mass = informative_mass(a, b)
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
    _refuse_uninformative(len(table[0]), mass)
    return float(chi2_contingency(table, correction=False).pvalue)


def marginal_pvalue(a: Sequence[int], b: Sequence[int]) -> float:
    """Chi-square p-value of two samples of single tokens: every token drawn at least 2 x MIN_CELL times in the pooled
    sample is a cell, the rest one pooled cell (every expected count >= MIN_CELL at equal arm sizes).
    UninformativeTest when fewer than MIN_CELLS cells remain or the tokens' own cells hold less than MIN_MASS."""
    ca, cb = Counter(a), Counter(b)
    pooled = ca + cb
    keys = sorted((k for k, n in pooled.items() if n >= 2 * MIN_CELL), key=lambda k: -pooled[k])
    rows = [[ca[k], cb[k]] for k in keys]
    other = [len(a) - sum(ca[k] for k in keys), len(b) - sum(cb[k] for k in keys)]
    if sum(other):
        rows.append(other)
    _refuse_uninformative(len(rows), sum(pooled[k] for k in keys) / max(1, len(a) + len(b)))
    return float(chi2_contingency(rows).pvalue)


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
