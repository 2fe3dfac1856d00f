"""Per-position acceptance statistics and expected committed tokens per step.

Why: the policy needs E_r(b), the expected tokens request r commits in one step at block b, for every candidate b
at once. E_r(b) = 1 + sum_{j<b} prod_{i<=j} p_{r,i}, where p_{r,j} is the conditional probability that draft token
j is accepted given tokens 1..j-1 were.

Model:
  * Exponentially decayed counts (accepted a_j, tried n_j), j = 1..J (J = B_max - 1), kept per slot and, per prior
    class, globally (class_priors.py: the classes, their decay per observed step and their chained prior).
    A request's counts decay by ``decay`` at every decode STEP it is in the batch (``step``): its memory is in
    time, so a request that stops being observed (width 1 between probes) relaxes toward its class's estimate.
  * Request estimate shrunk toward its class's global one p_gj: p_rj = (a_rj + k*p_gj) / (n_rj + k).

Observations (``observe``) take the one form observations.py defines: ``(slot, accepted_len, tried)``, censored at
``tried``, each event fed once.

Invariants (tested): 0 <= p <= 1; E_r(b) is non-decreasing in b and 1 <= E_r(b) <= b.
"""

from __future__ import annotations

import numpy as np

from .class_priors import ClassPriors
from .observations import position_counts


class AcceptanceStats:
    """Decayed per-position acceptance counts, global and per slot; vectorised estimates."""

    def __init__(
        self,
        max_block: int,
        *,
        decay: float = 0.99,
        global_decay: float = 0.99,
        prior_strength: float = 8.0,
        global_prior_mean: float = 0.5,
        global_prior_strength: float = 2.0,
        capacity: int = 64,
        classes: int = 1,
    ) -> None:
        if max_block < 1:
            raise ValueError(f"max_block: must be >= 1, got {max_block}")
        self.max_block = max_block
        self.J = max_block - 1
        self.decay = float(decay)
        self.global_decay = float(global_decay)
        self.k = float(prior_strength)
        self.priors = ClassPriors(classes, self.J, decay=global_decay, prior_mean=global_prior_mean,
                                  prior_strength=global_prior_strength)
        self.classes = self.priors.classes
        self.slot_class = np.zeros(0, dtype=np.intp)  # each slot's prior class (set by the caller, 0 when reset)
        self.capacity = 0
        # Position-major [J, capacity]: the hot path gathers columns and runs cumprod over contiguous rows.
        self.a_r = np.zeros((self.J, 0))
        self.n_r = np.zeros((self.J, 0))
        self._mats: dict[bytes, np.ndarray] = {}
        # Bumped by every change but the per-step decay (step()): observations, resets, classes, growth. A caller
        # may reuse an estimate while it is unchanged (BlockSizeController._goodput_reused).
        self.version = 0
        self._decay_slots: np.ndarray | None = None  # step(): the batch whose repeated steps' decay is deferred
        self._decay_steps = 0  # and how many steps of it are
        self.resize(capacity)

    # -- storage ----------------------------------------------------------------------------------------------
    def resize(self, capacity: int) -> None:
        """Grow per-slot arrays to ``capacity`` rows."""
        self.flush_decay()
        if capacity <= self.capacity:
            return
        a = np.zeros((self.J, capacity))
        n = np.zeros((self.J, capacity))
        a[:, : self.capacity] = self.a_r
        n[:, : self.capacity] = self.n_r
        c = np.zeros(capacity, dtype=np.intp)
        c[: self.capacity] = self.slot_class
        self.a_r, self.n_r, self.slot_class, self.capacity = a, n, c, capacity
        self.version += 1

    def reset(self, slots: np.ndarray) -> None:
        """Zero the per-request counts of ``slots`` (request finished or slot reused); their class becomes 0."""
        self.flush_decay()
        self.a_r[:, slots] = 0.0
        self.n_r[:, slots] = 0.0
        self.slot_class[slots] = 0
        self.version += 1

    def soften_global(self, steps: float) -> None:
        """Keep every class's global estimate at the weight of ``steps`` observations at most (ClassPriors.shrink):
        the drafter it described was replaced by one close to it. Per-request counts stay: a running request keeps
        drafting from the context its old drafter wrote."""
        self.flush_decay()
        self.priors.shrink(steps)
        self.version += 1

    def set_classes(self, slots: np.ndarray, classes: np.ndarray) -> None:
        """The prior class of each of ``slots`` (PRIOR_CLASSES in request_state.py)."""
        if not np.array_equal(self.slot_class[slots], classes):
            self.flush_decay()  # the deferred decay applies to the classes the slots had
            self.slot_class[slots] = classes
            self.version += 1

    @property
    def a_g(self) -> np.ndarray:
        """Global accepted counts pooled over classes [J]."""
        self.flush_decay()
        return self.priors.a.sum(axis=0)

    @property
    def n_g(self) -> np.ndarray:
        """Global tried counts pooled over classes [J]."""
        self.flush_decay()
        return self.priors.n.sum(axis=0)

    @property
    def _a_g(self) -> np.ndarray:
        """Per-class global counts [classes, J] as they stand (no deferred decay applied; tests compare runs by it)."""
        return self.priors.a

    @property
    def _n_g(self) -> np.ndarray:
        """As ``_a_g``, the tried counts."""
        return self.priors.n

    # -- updates ----------------------------------------------------------------------------------------------
    def step(self, slots: np.ndarray, steps: int = 1) -> None:
        """``steps`` decode steps elapsed with ``slots`` in the batch: decay their counts; their classes' global
        counts decay at their next observation (class_priors.py).

        Called again with the very same array object, the decay is deferred to the next read or change of the
        counts, where k such steps cost one multiplication by decay**k. Why: with speculation off a step observes
        nothing else, and the decay's small numpy calls are a noticeable part of a width-1 step in a server
        (cache-cold). A caller that passes a fresh array per step gets the decay at once."""
        if slots is self._decay_slots:
            self._decay_steps += steps
            return
        self.flush_decay()
        self._decay(slots, steps)
        self._decay_slots = slots

    def flush_decay(self) -> None:
        """Apply the decay of the steps ``step`` deferred (every read and change of the counts calls this)."""
        if self._decay_steps:
            k, self._decay_steps = self._decay_steps, 0
            self._decay(self._decay_slots, k)

    def _decay(self, slots: np.ndarray, k: int) -> None:
        if self.decay < 1.0:
            d = self.decay ** k
            self.a_r[:, slots] *= d
            self.n_r[:, slots] *= d
        self.priors.mark_stepped(0 if self.classes == 1 else self.slot_class[slots])

    def observe(self, slots: np.ndarray, accepted: np.ndarray, tried: np.ndarray) -> None:
        """Add observations ``(slots[i], accepted[i], tried[i])`` to the slot and global counts (no decay)."""
        self.flush_decay()
        m = int(np.size(slots))
        if m == 0 or self.J == 0:
            return
        uniq, inv = np.unique(np.asarray(slots, dtype=np.intp), return_inverse=True)
        A, N = position_counts(inv, uniq.size, accepted, tried, self.J)
        self.a_r[:, uniq] += A.T
        self.n_r[:, uniq] += N.T
        self.version += 1 + self.priors.add_rows(self.slot_class[uniq], A, N)

    def observe_global_only(self, accepted: np.ndarray, tried: np.ndarray, cls: int = 0) -> None:
        """Observations whose request is gone (flushed at finish): class ``cls``'s global counts only."""
        self.flush_decay()
        m = int(np.size(accepted))
        if m == 0 or self.J == 0:
            return
        A, N = position_counts(np.zeros(m, dtype=np.int64), 1, accepted, tried, self.J)
        self.priors.add(int(cls), A[0], N[0])
        self.version += 1

    # -- estimates --------------------------------------------------------------------------------------------
    def class_p(self) -> np.ndarray:
        """Global p_j of every class -> [classes, J] (cached until the next update)."""
        self.flush_decay()
        return self.priors.p()

    def global_p(self) -> np.ndarray:
        """Global p_j, j = 1..J, of all classes' counts pooled (what the metrics publish)."""
        self.flush_decay()
        return self.priors.pooled_p()

    def request_p(self, slots: np.ndarray, classes: np.ndarray | None = None) -> np.ndarray:
        """Shrunk per-request p_rj for ``slots`` -> [len(slots), J]. Slot 0 (no data) gives its class's global p.
        ``classes``: each slot's prior class for this call (None: the slots' own, ``slot_class``)."""
        return self._request_p_t(slots, classes).T

    def _request_p_t(self, slots: np.ndarray, classes: np.ndarray | None = None) -> np.ndarray:
        """Position-major [J, len(slots)] estimates (a fresh array the caller may overwrite)."""
        self.flush_decay()
        a = self.a_r.take(slots, axis=1)
        n = self.n_r.take(slots, axis=1)
        if classes is None and self.classes > 1:
            classes = self.slot_class.take(slots)
        mixed = classes is not None and classes.any()  # else every request is class 0's
        if self.k > 0.0:
            kpg = self.priors.prior_counts_t(self.k)  # [J, classes]
            a += kpg.take(classes, axis=1) if mixed else kpg[:, :1]
            n += self.k
            a /= n
            return a
        pg = self.priors.p().T.take(classes, axis=1) if mixed else self.priors.p()[0][:, None]
        safe = np.where(n > 0.0, n, 1.0)
        return np.where(n > 0.0, a / safe, pg)

    def expected_tokens(self, slots: np.ndarray, blocks: np.ndarray,
                        classes: np.ndarray | None = None) -> np.ndarray:
        """E_r(b) for each slot and block -> [len(slots), len(blocks)] (blocks are 1..max_block)."""
        blocks = np.asarray(blocks, dtype=np.int64)
        p = self._request_p_t(slots, classes)
        s = np.zeros((self.J + 1, p.shape[1]))
        np.cumsum(np.cumprod(p, axis=0), axis=0, out=s[1:])
        return 1.0 + s[blocks - 1].T

    def _block_matrix(self, blocks: np.ndarray) -> np.ndarray:
        """[len(blocks), J] indicator M[k, j] = (j + 1 < blocks[k]): E = 1 + M @ cumprod(p) (cached per blocks)."""
        b = np.asarray(blocks, dtype=np.int64)
        key = b.tobytes()
        m = self._mats.get(key)
        if m is None:
            m = (np.arange(1, self.J + 1)[None, :] < b[:, None]).astype(float)
            self._mats[key] = m
        return m

    def expected_tokens_t(self, slots: np.ndarray, blocks: np.ndarray,
                          classes: np.ndarray | None = None) -> np.ndarray:
        """E_r(b) block-major -> [len(blocks), len(slots)] (the decision's hot path; fresh array)."""
        if not self.J:
            return np.ones((len(blocks), slots.shape[0]))
        p = self._request_p_t(slots, classes)
        np.multiply.accumulate(p, axis=0, out=p)
        e = self._block_matrix(blocks) @ p
        e += 1.0
        return e

    def batch_expected_tokens(self, slots: np.ndarray, blocks: np.ndarray,
                              classes: np.ndarray | None = None) -> np.ndarray:
        """sum_r E_r(b) over the batch for each block -> [len(blocks)]. The decision's hot path."""
        n = slots.shape[0]
        s = np.empty(self.J + 1)
        s[0] = 0.0
        if self.J:
            p = self._request_p_t(slots, classes)
            np.cumprod(p, axis=0, out=p)
            np.cumsum(p.sum(axis=1), out=s[1:])
        return n + s[blocks - 1]
