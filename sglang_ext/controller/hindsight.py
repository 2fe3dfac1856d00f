"""Hindsight acceptance: compare a full drafted block with the tokens the target later committed.

Why: verifying width b only observes draft positions < b (censoring). Once the target has committed the tokens that
follow a drafted block, the first mismatch between the FULL drafted block and the committed stream is the
acceptance length a width-B_max verify would have produced (exact for greedy; for target-only sampling,
``committed_j == draft_j`` is an unbiased draw of the acceptance event). So far positions are learned at zero
verify cost.

Contract:
  * ``add_blocks(slots, drafted)`` registers, for each slot, the block drafted after the slot's current last
    committed token (the anchor). Call it BEFORE ``append`` of the same step.
  * ``append(slots, counts, tokens)`` appends that step's committed tokens (>= 1 per slot per step).
  * ``resolve(slots)`` returns every pending block of those slots that is now decided, as
    ``(slot, accepted_len, tried)`` with ``tried = J``: positions 1..accepted_len matched and, if
    ``accepted_len < J``, position accepted_len + 1 did not. Decided blocks are forgotten.
  * ``flush(slot)`` (request finished) returns the undecided blocks as censored observations
    (``accepted_len = tried = tokens seen``: everything seen matched, nothing rejected) and clears the slot.
  * Memory per slot is O(J^2) tokens: at most J blocks can be pending, because each step commits >= 1 token and a
    block is decided after J committed tokens.
  * While no block of any slot is undecided (``has_pending()`` False) the committed stream is never read (a block
    added later compares only tokens committed after it), so callers may skip ``append``: the skipped steps of
    speculation off (width 1 between probes) then cost nothing here.
All work is vectorised over slots and pending blocks (no per-request Python loop).
"""

from __future__ import annotations

import numpy as np


class HindsightBuffer:
    """Per-slot ring of committed tokens plus the drafted blocks still waiting for their continuation."""

    def __init__(self, max_block: int, capacity: int) -> None:
        if max_block < 2:
            raise ValueError(f"max_block: hindsight needs a drafter block >= 2, got {max_block}")
        self.J = max_block - 1  # draft tokens after the anchor
        self.P = self.J  # pending blocks per slot (see module docstring)
        ring = 1
        while ring < 2 * max_block:
            ring *= 2
        self.L = ring  # >= J + max tokens committed per step, power of two for cheap modulo
        self._mask = ring - 1
        self._arJ = np.arange(self.J, dtype=np.int64)
        self.capacity = 0
        self.ring = np.zeros((0, self.L), dtype=np.int64)
        self.stream_len = np.zeros(0, dtype=np.int64)
        self.n_blocks = np.zeros(0, dtype=np.int64)
        self.pend_tok = np.zeros((0, self.P, self.J), dtype=np.int64)
        self.pend_start = np.zeros((0, self.P), dtype=np.int64)
        self.pend_valid = np.zeros((0, self.P), dtype=bool)
        self.resize(capacity)

    def resize(self, capacity: int) -> None:
        """Grow the per-slot arrays to ``capacity`` rows (existing rows kept)."""
        old = self.capacity
        if capacity <= old:
            return

        def grow(a: np.ndarray) -> np.ndarray:
            out = np.zeros((capacity,) + a.shape[1:], dtype=a.dtype)
            out[:old] = a
            return out

        self.ring = grow(self.ring)
        self.stream_len = grow(self.stream_len)
        self.n_blocks = grow(self.n_blocks)
        self.pend_tok = grow(self.pend_tok)
        self.pend_start = grow(self.pend_start)
        self.pend_valid = grow(self.pend_valid)
        self.capacity = capacity

    def has_pending(self) -> bool:
        """Some slot has an undecided block."""
        return bool(self.pend_valid.any())

    def reset(self, slots: np.ndarray) -> None:
        """Forget everything about ``slots`` (a new request took them over)."""
        self.stream_len[slots] = 0
        self.n_blocks[slots] = 0
        self.pend_valid[slots] = False

    def add_blocks(self, slots: np.ndarray, drafted: np.ndarray) -> None:
        """Register ``drafted[i]`` (J tokens after the anchor) as pending for ``slots[i]``."""
        col = self.n_blocks[slots] % self.P
        self.pend_tok[slots, col] = drafted
        self.pend_start[slots, col] = self.stream_len[slots]
        self.pend_valid[slots, col] = True
        self.n_blocks[slots] += 1

    def append(self, slots: np.ndarray, counts: np.ndarray, tokens: np.ndarray) -> None:
        """Append ``counts[i]`` tokens (consecutive in ``tokens``) to ``slots[i]``'s committed stream."""
        total = int(tokens.shape[0])
        if total == 0:
            return
        rows = np.repeat(slots, counts)
        starts = np.cumsum(counts) - counts
        offs = np.arange(total, dtype=np.int64) - np.repeat(starts, counts)
        pos = (self.stream_len[rows] + offs) & self._mask
        self.ring[rows, pos] = tokens
        self.stream_len[slots] += counts

    def resolve(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Decided blocks of ``slots`` as ``(slot, accepted_len, tried)``; they are removed."""
        valid = self.pend_valid[slots]
        rows, cols = np.nonzero(valid)
        if rows.size == 0:
            empty = np.zeros(0, dtype=np.int64)
            return empty.astype(np.intp), empty, empty
        s = slots[rows]
        start = self.pend_start[s, cols]
        avail = self.stream_len[s] - start
        idx = (start[:, None] + self._arJ) & self._mask
        seen = self.ring[s[:, None], idx]
        draft = self.pend_tok[s, cols]
        mism = (seen != draft) & (self._arJ < avail[:, None])
        has = mism.any(axis=1)
        done = has | (avail >= self.J)
        if not done.any():
            empty = np.zeros(0, dtype=np.int64)
            return empty.astype(np.intp), empty, empty
        length = np.where(has, mism.argmax(axis=1), self.J)
        self.pend_valid[s[done], cols[done]] = False
        acc = length[done].astype(np.int64)
        return s[done], acc, np.full(acc.shape, self.J, dtype=np.int64)

    def flush(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """Undecided blocks of a finishing ``slot`` as censored ``(accepted_len, tried)``; clears the slot."""
        cols = np.flatnonzero(self.pend_valid[slot])
        seen = np.minimum(self.stream_len[slot] - self.pend_start[slot, cols], self.J).astype(np.int64)
        self.pend_valid[slot] = False
        self.stream_len[slot] = 0
        self.n_blocks[slot] = 0
        keep = seen > 0
        return seen[keep], seen[keep]
