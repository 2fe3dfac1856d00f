"""Global acceptance counts per prior class: the estimate every request's own counts are shrunk toward.

Why: a new request has no counts of its own, so its first widths come from what the traffic before it accepted. What
a drafter's guesses are worth differs by class -- a greedy request accepts a draft token that is the target's argmax,
a sampled one with the target's probability of it; with one prior, sampled prose after a greedy code phase started
from the code prior and drafted wide for about one token a step (docs/ADAPTIVE.md). So the global counts are kept per
prior class (the policy uses two: greedy and sampled requests), and acceptance.py shrinks a request toward its own
class's estimate.

Contract:
  * Counts (accepted ``a``, tried ``n``) [classes, J] decay by ``decay`` once per step that OBSERVES the class
    (a verify past width 1, a hindsight block resolved), before that step's observations are added (``add``,
    ``add_rows``): their memory is in observed steps. ``mark_stepped(classes)`` says a step passed with those
    classes in the batch; the next add to such a class decays it first. Why: the global estimate is every new
    request's prior, and a width-1 stretch observes nothing -- decayed per step, the evidence that drafts are never
    accepted (prose at temperature 1) faded back to the flat prior between probes spaced by their price
    (probes.py), and new requests started out drafting again. A class absent from the batch is not observed, so
    its counts keep (a decayed class falls back to the flat prior, which prices drafting at E(4) ~ 1.9 for either
    kind of traffic).
  * ``p()`` -> [classes, J]: the estimate with a prior chained along positions, p_1 = (a_1 + s0*m0) / (n_1 + s0) and
    p_j = (a_j + s0*p_{j-1}) / (n_j + s0). Why: far positions are rarely tried (only after j-1 acceptances), so their
    prior should be their neighbour's estimate, not a flat m0 (which overstated long blocks on chat).
  * ``prior_counts_t(k)`` -> [J, classes]: k * p, position-major, the pseudo-counts a request's estimate adds.
  * ``shrink(steps)`` keeps each class's estimate
    but scales its counts down to at most ``steps`` tries of position 1, so that so many steps of new evidence
    weigh as much as all the old.
  * The owner (AcceptanceStats) applies its deferred per-step decay before it calls any of these.

Invariants: 0 <= p <= 1; ``p()`` and ``prior_counts_t`` are cached until the next ``add`` or ``shrink`` (callers must
not write into them); pure numpy.
"""

from __future__ import annotations

import numpy as np


def chained(a: np.ndarray, n: np.ndarray, m0: float, s0: float) -> np.ndarray:
    """[C, J] counts -> [C, J] estimates with the prior chained along positions (module contract).

    p_j = alpha_j p_{j-1} + beta_j (alpha_j = s0 / (n_j + s0), beta_j = a_j / (n_j + s0), p_0 = m0) in closed
    form: p_j = P_j (m0 + sum_{i<=j} beta_i / P_i), P_j = prod_{k<=j} alpha_k -- a few array operations
    instead of a Python loop over positions (this runs at every decision: the step's decay changes the counts).
    P_j >= (s0 / (n_max + s0))^J stays far above float64's range limit for any count this process reaches."""
    den = n + s0
    P = np.cumprod(s0 / den, axis=1)
    return P * (m0 + np.cumsum(a / den / P, axis=1))


class ClassPriors:
    """Decayed global per-position counts of each prior class and their chained estimates (module contract)."""

    def __init__(self, classes: int, J: int, *, decay: float, prior_mean: float, prior_strength: float) -> None:
        if classes < 1:
            raise ValueError(f"classes: must be >= 1, got {classes}")
        self.classes = int(classes)
        self.decay = float(decay)
        self.m0 = float(prior_mean)
        self.s0 = float(prior_strength)
        self.a = np.zeros((self.classes, J))  # [class, J]
        self.n = np.zeros((self.classes, J))
        self._due = np.zeros(self.classes, dtype=bool)  # a step passed since the class's last decay
        self._p: np.ndarray | None = None
        self._kp_t: np.ndarray | None = None  # k * p position-major, for the k in _kp_k
        self._kp_k = 0.0

    def mark_stepped(self, classes: int | np.ndarray) -> None:
        """A step passed with ``classes`` (one class or an array of them) in the batch: decay at their next add."""
        self._due[classes] = True

    def add(self, cls: int, a: np.ndarray, n: np.ndarray) -> None:
        """Add one step's position counts ``a``, ``n`` [J] to class ``cls``, decayed first if a step passed."""
        if self._due[cls] and self.decay < 1.0:  # once per step that observes the class
            self.a[cls] *= self.decay
            self.n[cls] *= self.decay
        self._due[cls] = False
        self.a[cls] += a
        self.n[cls] += n
        self._p = self._kp_t = None

    def add_rows(self, cls: np.ndarray, a: np.ndarray, n: np.ndarray) -> int:
        """Add each row of ``a``, ``n`` [rows, J] to its class ``cls`` [rows] -> how many classes were added to."""
        if self.classes == 1 or not cls.any():
            self.add(0, a.sum(axis=0), n.sum(axis=0))
            return 1
        added = 0
        for c in range(self.classes):  # a few classes: masked sums beat np.add.at's per-row scatter
            mine = cls == c
            if mine.any():
                self.add(c, a[mine].sum(axis=0), n[mine].sum(axis=0))
                added += 1
        return added

    def shrink(self, steps: float) -> None:
        """Scale each class's counts to at most ``steps`` tries of position 1 (its ratios a_j / n_j kept)."""
        tried = self.n[:, :1]
        scale = np.where(tried > steps, steps / np.maximum(tried, 1e-12), 1.0)
        self.a *= scale
        self.n *= scale
        self._p = self._kp_t = None

    def p(self) -> np.ndarray:
        """p_j of every class -> [classes, J] (cached)."""
        if self._p is None:
            self._p = chained(self.a, self.n, self.m0, self.s0)
        return self._p

    def pooled_p(self) -> np.ndarray:
        """p_j, j = 1..J, of all classes' counts pooled -> [J]."""
        if self.classes == 1:
            return self.p()[0]
        return chained(self.a.sum(axis=0)[None], self.n.sum(axis=0)[None], self.m0, self.s0)[0]

    def prior_counts_t(self, k: float) -> np.ndarray:
        """k * p position-major -> [J, classes]: what a request's accepted counts add (cached)."""
        if self._kp_t is None or k != self._kp_k:
            self._kp_t, self._kp_k = k * self.p().T, k
        return self._kp_t
