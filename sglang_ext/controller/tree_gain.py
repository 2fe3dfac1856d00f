"""What a DDTree buys over the chain: tokens per request-step a tree of width w commits past chain B's, learned online.

Why: the controller scores a width by expected committed tokens over step cost. A chain's expected tokens come from
per-position acceptance (acceptance.py); a tree's are chain B's plus what its other branches add -- or minus what
it loses where its budget leaves out the deep end of the greedy chain (a narrow tree often stops shallow on code
the chain would have accepted deep). One tree step at width w measures this for every narrower tree
too: the tree's nodes are in score order (tree/build.py), so the tree of the best w' - 1 prefixes is its first
w' - 1 nodes, and the target's choice at a node does not depend on which other nodes are verified, so the narrower
tree walks the same path up to the path's first node outside it (exact for greedy; for sampling exact under the
coupling that draws the target's choice at a node once, which leaves each tree's distribution unchanged). Chain B
on the same step accepts the path's agreement with the greedy draft (a lower bound when the path leaves the tree
on the greedy token itself, which the chain would have verified further).

Why not calibrated marginals (DDTree's surrogate, calibrated online): the counterfactual above measures the
quantity the controller needs -- tokens per step of each candidate tree, under this traffic -- with no model
between; what it cannot see is a tree wider than any verified since the traffic changed, which the controller's
exploration of never- or long-unmeasured widths covers (exploration.py).

Contract:
  * ``tree_commits(path, widths)``: path [bs, D] node indices of the walked path (-1 past its end) -> [bs, len(widths)]
    draft tokens the tree of each width would have accepted;
  * ``TreeGain(widths)``: ``observe(extra, observed)`` folds one tree step's per-request extras (tokens accepted past
    chain B's, per width; ``observed`` [len(widths)] masks the widths the step could measure: those <= its own);
    ``extra()`` [len(widths)]: the expected extra per request-step, shrunk toward 0 by ``prior_strength``
    request-steps (an unmeasured tree is worth what the chain is: never chosen for its tokens, only explored).
Invariants: pure numpy, no torch, no SGLang; every TP rank feeds identical paths, so every rank holds identical
estimates (the decisions read them); decay is per observed step, so evidence waits while no tree runs.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def tree_commits(path: np.ndarray, widths: Sequence[int]) -> np.ndarray:
    """Draft tokens each tree width would have accepted on a walked ``path`` (module contract)."""
    p = np.asarray(path)
    budgets = np.asarray(widths, dtype=np.int64) - 1  # a width-w tree holds nodes 0 .. w - 2
    inside = (p[:, None, :] >= 0) & (p[:, None, :] < budgets[None, :, None])  # [bs, widths, D]
    return np.cumprod(inside, axis=2).sum(axis=2)


def check_decay_and_prior(decay: float, prior_strength: float) -> None:
    """The arguments every per-width decayed estimate takes (this one and calibration.py's)."""
    if not 0.0 < decay <= 1.0:
        raise ValueError(f"decay: must be in (0, 1], got {decay!r}")
    if prior_strength < 0.0:
        raise ValueError(f"prior_strength: must be >= 0, got {prior_strength!r}")


class TreeGain:
    """Decayed mean of the tokens per request-step each tree width commits past chain B (module contract)."""

    def __init__(self, widths: Sequence[int], *, decay: float = 0.99, prior_strength: float = 8.0) -> None:
        check_decay_and_prior(decay, prior_strength)
        self.widths = tuple(int(w) for w in widths)
        self.decay = float(decay)
        self.prior_strength = float(prior_strength)
        self._sum = np.zeros(len(self.widths))
        self._n = np.zeros(len(self.widths))
        self.steps = np.zeros(len(self.widths), dtype=np.int64)  # tree steps that measured each width
        self.version = 0  # bumped by every observation

    def observe(self, extra: np.ndarray, observed: np.ndarray) -> None:
        """``extra`` [bs, len(widths)]: tokens accepted past chain B's per request; ``observed`` [len(widths)] bool."""
        e = np.asarray(extra, dtype=float)
        m = np.asarray(observed, dtype=bool)
        if e.ndim != 2 or e.shape[1] != len(self.widths) or m.shape != (len(self.widths),):
            raise ValueError(f"extra: expected [bs, {len(self.widths)}] and observed [{len(self.widths)}], got "
                             f"{e.shape} and {m.shape}")
        self._sum[m] = self._sum[m] * self.decay + e[:, m].sum(axis=0)
        self._n[m] = self._n[m] * self.decay + e.shape[0]
        self.steps[m] += 1
        self.version += 1

    def extra(self) -> np.ndarray:
        """Expected tokens per request-step past chain B, per width (0 before any evidence)."""
        return self._sum / np.maximum(self._n + self.prior_strength, 1e-12)
