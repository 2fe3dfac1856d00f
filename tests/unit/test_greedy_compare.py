"""The GPU tests' greedy identity check (tests/greedy_compare.py) fails what it is there to catch: an empty, short or
long speculative output, an early divergence, a bf16 run where most outputs part from plain decoding's."""
from __future__ import annotations

import pytest

from tests.greedy_compare import MIN_AGREED, assert_same_greedy, greedy_mismatches

BASE = [list(range(100, 228)), list(range(300, 428))]  # two 128-token outputs


@pytest.mark.parametrize("strict", [True, False], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("spec, why", [
    ([[], BASE[1]], "empty"),
    ([BASE[0][:40], BASE[1]], "short"),
    ([BASE[0][:MIN_AGREED - 1], BASE[1]], "shorter than the agreed prefix"),
    ([BASE[0] + [7], BASE[1]], "long"),
    ([[9] + BASE[0][1:], BASE[1]], "differs at the first token"),
    ([BASE[0]], "an output missing"),
])
def test_what_breaks_the_identity_fails(spec, why, strict):
    assert greedy_mismatches(BASE, spec, strict), why
    with pytest.raises(AssertionError):
        assert_same_greedy(BASE, spec, strict)


def test_identical_outputs_pass():
    assert_same_greedy(BASE, [list(b) for b in BASE], strict=True)
    assert_same_greedy(BASE, [list(b) for b in BASE], strict=False)


def test_bf16_allows_a_late_tie_flip_in_some_outputs_not_most():
    late = [BASE[0][:100] + [1] * 28, BASE[1]]
    assert greedy_mismatches(BASE, late, strict=True)
    assert not greedy_mismatches(BASE, late, strict=False)
    both_late = [BASE[0][:100] + [1] * 28, BASE[1][:90] + [1] * 38]
    assert greedy_mismatches(BASE, both_late, strict=False)  # none equal in full: more than a tie
