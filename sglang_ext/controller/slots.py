"""Request id -> row ("slot") of the per-request numpy arrays.

Why: per-request statistics live in dense arrays so the hot path is vectorised; this map owns which row belongs to
which live request, recycles rows of finished requests, and tells owners when the arrays must grow.

Contract:
  * Slot 0 is reserved and never assigned: it is an all-zero "no data yet" row, so a lookup of an unknown id
    (``lookup``) can return 0 and the estimate falls back to the global one without allocating anything.
  * ``assign`` allocates rows for unknown ids (reusing freed rows first), ``release`` frees one. The number of
    rows in use equals the number of live requests plus one, whatever the number of requests ever seen.
  * ``capacity`` only grows (doubling); owners resize their arrays when ``assign`` reports growth.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from itertools import repeat

import numpy as np


class SlotMap:
    """Dense slot allocator keyed by request id."""

    def __init__(self, initial_capacity: int = 64) -> None:
        self._capacity = max(2, int(initial_capacity))
        self._slot: dict[Hashable, int] = {}
        self._free: list[int] = list(range(self._capacity - 1, 0, -1))  # pop() yields 1, 2, ...
        self.generation = 0  # bumped whenever an id gains or loses a row (invalidates cached lookups)

    @property
    def capacity(self) -> int:
        """Rows the owners' arrays must have."""
        return self._capacity

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, rid: Hashable) -> bool:
        return rid in self._slot

    def lookup(self, request_ids: Sequence[Hashable]) -> np.ndarray:
        """Rows of ``request_ids`` (0 for unknown ids); C-level iteration, no allocation."""
        get = self._slot.get
        return np.fromiter(map(get, request_ids, repeat(0)), dtype=np.intp, count=len(request_ids))

    def assign(self, request_ids: Sequence[Hashable]) -> tuple[np.ndarray, np.ndarray, bool]:
        """Rows of ``request_ids``, allocating unknown ones.

        Returns ``(slots, new_slots, grew)``: ``new_slots`` are rows just assigned (owners must reset them) and
        ``grew`` says the capacity increased (owners must resize first).
        """
        slots = self.lookup(request_ids)
        if slots.all():
            return slots, slots[:0], False
        grew = False
        new: list[int] = []
        for i in np.flatnonzero(slots == 0):
            rid = request_ids[i]
            s = self._slot.get(rid)  # duplicates within one call
            if s is None:
                if not self._free:
                    old = self._capacity
                    self._capacity = old * 2
                    self._free = list(range(self._capacity - 1, old - 1, -1))
                    grew = True
                s = self._free.pop()
                self._slot[rid] = s
                self.generation += 1
                new.append(s)
            slots[i] = s
        return slots, np.asarray(new, dtype=np.intp), grew

    def release(self, rid: Hashable) -> int | None:
        """Free ``rid``'s row; returns it (or None if the id was unknown)."""
        s = self._slot.pop(rid, None)
        if s is not None:
            self._free.append(s)
            self.generation += 1
        return s

    def live_slots(self) -> np.ndarray:
        """Rows currently assigned."""
        return np.fromiter(self._slot.values(), dtype=np.intp, count=len(self._slot))
