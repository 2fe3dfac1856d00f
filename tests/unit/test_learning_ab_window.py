"""benchmarks/learning_ab.py's window(): the drafter's full-block figure from the per-position counters says how many
positions it holds, so a sum cut short (positions left untried: narrow widths, e.g. right after a drafter swap) is
not read as the full block's."""
from __future__ import annotations

import sys

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))


def _snap(tried: list[int], accepted: list[int]) -> dict:
    return {"dflash_tried_tokens_by_position_total": [({"position": str(k)}, float(t)) for k, t in enumerate(tried)],
            "dflash_accepted_tokens_by_position_total": [({"position": str(k)}, float(a))
                                                         for k, a in enumerate(accepted)]}


def test_the_block_figure_names_the_positions_it_sums():
    from learning_ab import window

    zero = _snap([0] * 4, [0] * 4)
    full = window(zero, _snap([100, 80, 60, 50], [80, 60, 50, 40]), 1.0)
    assert full["block_positions"] == 4
    p = [.8, .75, 50 / 60, .8]
    assert abs(full["drafter_block_acceptance"] - (1 + p[0] + p[0] * p[1] + p[0] * p[1] * p[2]
                                                   + p[0] * p[1] * p[2] * p[3])) < 1e-3
    cut = window(zero, _snap([100, 80, 0, 0], [80, 60, 0, 0]), 1.0)  # the deep positions never tried
    assert cut["block_positions"] == 2 and abs(cut["drafter_block_acceptance"] - (1 + .8 + .8 * .75)) < 1e-3
