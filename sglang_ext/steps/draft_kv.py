"""The committed tokens' target features appended to the draft KV, so the draft context stays current at every
width; a width-1 step's append deferred and written in one batched pass (docs/ARCHITECTURE.md §3, step 4)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# width-1 steps whose draft-KV appends are batched into one pass: bounds the features held (bs x D per step)
DEFERRED_APPEND_STEPS = 16


@dataclass(frozen=True)
class DeferredAppend:
    """One width-1 step's draft-KV append, not yet written: the committed token's target features and where the
    draft KV keeps them (draft-pool ids and positions). Width 1 commits exactly one token per request."""

    hidden: torch.Tensor  # [bs, D]
    cache_loc: torch.Tensor  # [bs] draft-pool KV slots
    positions: torch.Tensor  # [bs]


class DraftKV:
    """Writes committed tokens' features to the draft KV through upstream's writer (``write``:
    ``_append_target_hidden_to_draft_kv_by_loc``). Deferred appends are written before anything reads the draft
    KV (the caller flushes before a draft or a prefill), when a request leaves the batch (its slots may be handed
    on: one pass never writes a slot twice) and after DEFERRED_APPEND_STEPS steps; the draft KV is then what
    per-step appends write. ``defers``: width-1 steps defer (off: every step appends, the reference)."""

    def __init__(self, write: Callable[..., None], *, compact: bool, defers: bool) -> None:
        self._write = write
        self._compact = compact
        self.defers = defers
        self._pending: list[DeferredAppend] = []
        self._rids: list[str] = []  # the batch the pending appends were taken from

    def append(self, hidden: torch.Tensor, cache_loc: torch.Tensor, positions: torch.Tensor,
               commit_lens: torch.Tensor) -> None:
        """Append row i's first commit_lens[i] of its ``[bs, w]`` columns (``hidden`` [bs, w, D]; ``cache_loc``
        draft-pool slots, ``positions``).

        GPU: upstream's prefix-valid writer (it projects every column and writes the live prefix: no host sync).
        CPU (``compact``): only the committed rows are projected (upstream's flat writer): the lengths are host
        memory already, and a wide step would otherwise project every drafted row to keep the committed ones. A
        row's K/V depends on that row alone (up to the rounding of a matmul over fewer rows: the draft's proposals,
        never the committed tokens)."""
        bs, w = int(cache_loc.shape[0]), int(cache_loc.shape[1])
        if not self._compact:
            self._write(target_hidden=hidden.reshape(bs * w, -1), cache_loc=cache_loc.reshape(-1),
                        cache_loc_2d=cache_loc, positions=positions.reshape(-1), commit_lens=commit_lens)
            return
        if w > 1:
            keep = (torch.arange(w, device=commit_lens.device) < commit_lens.view(bs, 1)).view(-1).nonzero().view(-1)
            hidden = hidden.reshape(bs * w, -1).index_select(0, keep)
            cache_loc = cache_loc.reshape(-1).index_select(0, keep)
            positions = positions.reshape(-1).index_select(0, keep)
        self._write(target_hidden=hidden.reshape(-1, hidden.shape[-1]), cache_loc=cache_loc.reshape(-1),
                    positions=positions.reshape(-1))

    def defer(self, hidden: torch.Tensor, cache_loc: torch.Tensor, positions: torch.Tensor) -> None:
        """Keep a width-1 step's append ([bs, D], [bs], [bs]) for the next flush: copies, as a CUDA graph's output
        buffer is overwritten by the next replay."""
        self._pending.append(DeferredAppend(hidden.clone(), cache_loc.clone(), positions.to(torch.int64, copy=True)))

    def start_width1_step(self, rids: list[str]) -> None:
        """Before a width-1 step: a request that left the batch may have handed its KV slots on, so flush first."""
        if rids != self._rids:
            self.flush()
            self._rids = rids

    def end_width1_step(self) -> None:
        """After a width-1 step: flush once DEFERRED_APPEND_STEPS steps are pending (bounds the features held)."""
        if len(self._pending) >= DEFERRED_APPEND_STEPS:
            self.flush()

    def flush(self) -> None:
        """Write the deferred appends in one pass (the writer a per-step append uses)."""
        if not self._pending:
            return
        steps, self._pending = self._pending, []
        hidden = torch.cat([d.hidden for d in steps])
        cache_loc = torch.cat([d.cache_loc for d in steps])
        positions = torch.cat([d.positions for d in steps])
        n = int(cache_loc.numel())
        self.append(hidden.view(n, 1, -1), cache_loc.view(n, 1), positions.view(n, 1),
                    torch.ones(n, dtype=torch.int32, device=cache_loc.device))
