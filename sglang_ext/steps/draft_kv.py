"""The committed tokens' target features appended to the draft KV, so the draft context stays current at every
width; a width-1 step's append and a prefill's prompt context deferred and written in one batched pass before the
next draft reads them (docs/ARCHITECTURE.md §3, step 4)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

# bytes of target features held for deferred appends at most (a prompt's context counts one row per token): a
# prefill that would hold more is written at once, as upstream writes it, and width-1 steps flush once this much is
# held. Why bytes, not steps: a row is every captured layer's hidden state, ~40 KB for an 8B target in bf16 (a few
# prompts' worth here), 2 KB for the bundled pair; and a step bound wrote every request's rows every few steps
# whether or not it would draft again, which a request at width 1 to its end (or leaving without a prefix cache)
# never needs
DEFERRED_APPEND_BYTES = 64 << 20


@dataclass(frozen=True)
class DeferredAppend:
    """One deferred draft-KV append, not yet written: target features and where the draft KV keeps them (draft-pool
    ids and positions), one row per committed token -- a width-1 step's (one per request) or a prefill's prompt
    context (one per prompt token) --, and each row's owner: the tenure (DraftKV's number for a request holding its
    slots) the row was kept for."""

    hidden: torch.Tensor  # [n, D]
    cache_loc: torch.Tensor  # [n] draft-pool KV slots
    positions: torch.Tensor  # [n]
    owners: torch.Tensor  # [n] int64, host


def _owns_its_slots(req: Any, kv: Any, pool_idx: Any) -> bool:
    """Whether ``req`` still holds the KV slots it held as ``kv`` (SGLang's per-request KV record) at request-pool
    row ``pool_idx``: a request that finished, was aborted or retracted, or was re-admitted, does not (its slots may
    be handed on)."""
    return not (req.finished() or req.is_retracted or req.kv is not kv or kv.req_pool_idx != pool_idx)


class DraftKV:
    """Writes committed tokens' features to the draft KV through upstream's writer (``write``:
    ``_append_target_hidden_to_draft_kv_by_loc``).

    Deferred appends (width-1 steps, ``defer``; a prefill's prompt context, ``defer_prompt``) are written in one
    pass (``flush``) before anything reads the draft KV -- the caller flushes before every draft; a prefill reads
    none -- and once DEFERRED_APPEND_BYTES are held. Before any forward (``before_forward``), a request that has
    left (finished, aborted, retracted: its slots may be handed on) ends its tenure. Without ``keep_left`` (no
    prefix cache) its rows are never written: the next flush leaves them out. With it, its rows are parked (the
    cache may hand its slots to a later request's draft) and written before the first decode step after a prefill
    (or by any flush): never before a prefill, so a new request's first token does not wait for another's draft
    context. A parked row whose slot a later row or write has taken meanwhile (a duplicate of a cached prefix
    freed, the slot handed to the prefill) is stale and goes to the pool's padding slot 0, as SGLang's padded
    tokens do (``_keeper``: the latest owner of every slot, ``written``).

    So a request that never drafts pays no prompt context at its prefill, and none at all without a prefix cache;
    no pass writes a slot twice, and no row lands in a slot that has moved on; the draft KV a draft reads is what
    per-step appends write (tested against ``defers`` off: every step and every prefill written at once, the
    reference)."""

    def __init__(self, write: Callable[..., None], *, compact: bool, defers: bool, slots: Callable[[], int],
                 keep_left: bool = True) -> None:
        self._write = write
        self._compact = compact
        self.defers = defers
        self.keep_left = keep_left
        # the draft pool's slot count (its padding slot 0 included), asked once rows are first kept: the pool is
        # built after the worker
        self._slots = slots
        self._pending: list[DeferredAppend] = []
        # rid -> (Req, its KV record, its request-pool row, tenure): the slots a request held when its first pending
        # row was kept, numbered so that a re-admitted request's new rows are not its old ones
        self._owners: dict[str, tuple[Any, Any, Any, int]] = {}
        self._tenures = 0
        self._ended: list[int] = []  # tenures of requests that left, whose pending rows are never written
        self._parked: set[int] = set()  # tenures of requests that left, whose rows wait (before_forward)
        self._after_prefill = False  # a prefill ran since rows were parked: the next decode step writes them
        self._keeper: torch.Tensor | None = None  # [slots]: the tenure of the latest row kept in a slot (0: written)
        self._rows = 0  # rows pending
        self._bytes = 0  # their features' bytes
        self.rows_dropped = 0  # rows of requests that left, never written (keep_left off)

    @property
    def pending_rows(self) -> int:
        return self._rows

    def append(self, hidden: torch.Tensor, cache_loc: torch.Tensor, positions: torch.Tensor,
               commit_lens: torch.Tensor) -> None:
        """Append row i's first commit_lens[i] of its ``[bs, w]`` columns (``hidden`` [bs, w, D]; ``cache_loc``
        draft-pool slots, ``positions``).

        GPU: upstream's prefix-valid writer (it projects every column and writes the live prefix: no host sync).
        CPU (``compact``): only the committed rows are projected (upstream's flat writer): the lengths are host
        memory already, and a wide step would otherwise project every drafted row to keep the committed ones. A
        row's K/V depends on that row alone (up to the rounding of a matmul over fewer rows: the draft's proposals,
        never the committed tokens)."""
        self.written(cache_loc)  # a parked row kept for one of these slots is stale
        self._append(hidden, cache_loc, positions, commit_lens)

    def _append(self, hidden: torch.Tensor, cache_loc: torch.Tensor, positions: torch.Tensor,
                commit_lens: torch.Tensor) -> None:
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

    def _keep(self, hidden: torch.Tensor, cache_loc: torch.Tensor, positions: torch.Tensor,
              reqs: Sequence[Any], counts: Sequence[int] | None) -> None:
        tenures = []
        for r in reqs:
            owner = self._owners.get(r.rid)
            if owner is None:
                self._tenures += 1
                owner = self._owners[r.rid] = (r, r.kv, r.kv.req_pool_idx, self._tenures)
            tenures.append(owner[3])
        owners = torch.tensor(tenures, dtype=torch.int64)
        if counts is not None:
            owners = torch.repeat_interleave(owners, torch.tensor(counts, dtype=torch.int64))
        # copies: a CUDA graph's output buffer is overwritten by the next replay (the CPU's eager forward returns
        # new features every step: kept as they are)
        kept = DeferredAppend(hidden if self._compact else hidden.clone(), cache_loc.to(torch.int64, copy=True),
                              positions.to(torch.int64, copy=True), owners)
        self._pending.append(kept)
        if self.keep_left:
            self._keeper_map(kept.cache_loc).index_copy_(0, kept.cache_loc,
                                                         owners.to(kept.cache_loc.device, non_blocking=True))
        self._rows += int(cache_loc.numel())
        self._bytes += hidden.numel() * hidden.element_size()

    def defer(self, hidden: torch.Tensor, cache_loc: torch.Tensor, positions: torch.Tensor,
              reqs: Sequence[Any]) -> None:
        """Keep a width-1 step's append ([bs, D], [bs], [bs]; ``reqs`` its batch's requests) for the next flush."""
        self._keep(hidden, cache_loc, positions, reqs, None)

    def defer_prompt(self, hidden: torch.Tensor, cache_loc: torch.Tensor, positions: torch.Tensor,
                     reqs: Sequence[Any], extend_lens: Sequence[int]) -> bool:
        """Keep a prefill's prompt context ([n, D], [n], [n]: ``extend_lens[i]`` tokens of ``reqs[i]`` in turn) for
        the next flush -> False when it is not kept (deferring off, or it would hold more than
        DEFERRED_APPEND_BYTES): the caller writes it at once."""
        n = int(cache_loc.numel())
        size = hidden.numel() * hidden.element_size()
        if not self.defers or self._bytes + size > DEFERRED_APPEND_BYTES or sum(extend_lens) != n:
            return False
        self._keep(hidden, cache_loc, positions, reqs, extend_lens)
        return True

    def before_forward(self, *, decode: bool) -> None:
        """Before any forward: a request that no longer owns its slots ends its tenure -- its rows parked with
        ``keep_left``, else marked never to be written. Parked rows are written before the first ``decode`` step
        after a prefill (not ``decode``): that prefill admitted what was waiting, so no first token waits for them
        then -- where a request that left is followed by the next one (a closed loop), writing them at the very
        next step would delay exactly that request's prefill."""
        if self._owners:
            for rid in [rid for rid, o in self._owners.items() if not _owns_its_slots(*o[:3])]:
                tenure = self._owners.pop(rid)[3]
                if self.keep_left:
                    self._parked.add(tenure)
                else:
                    self._ended.append(tenure)
        if not decode:
            self._after_prefill = self._after_prefill or bool(self._parked)
        elif self._after_prefill:
            self.flush()

    def written(self, cache_loc: torch.Tensor) -> None:
        """The caller wrote these draft-pool slots itself (a prefill's prompt context written at once): a parked
        row kept for one of them before is stale."""
        if self._parked:
            self._keeper_map(cache_loc).index_fill_(0, cache_loc.reshape(-1).to(torch.int64), 0)

    def end_width1_step(self) -> None:
        """After a width-1 step: flush once DEFERRED_APPEND_BYTES are pending."""
        if self._bytes >= DEFERRED_APPEND_BYTES:
            self.flush()

    def flush(self) -> None:
        """Write the deferred appends in one pass (the writer a per-step append uses), but the rows of tenures that
        ended (``before_forward``); a parked row whose slot was taken since goes to the padding slot."""
        if not self._pending:
            return
        steps, self._pending, self._rows, self._bytes = self._pending, [], 0, 0
        ended, self._ended = self._ended, []
        parked, self._parked, self._after_prefill = self._parked, set(), False
        self._owners.clear()  # every row is written now: a request's next row starts a new tenure
        hidden = torch.cat([d.hidden for d in steps]) if len(steps) > 1 else steps[0].hidden
        cache_loc = torch.cat([d.cache_loc for d in steps]) if len(steps) > 1 else steps[0].cache_loc
        positions = torch.cat([d.positions for d in steps]) if len(steps) > 1 else steps[0].positions
        owners = torch.cat([d.owners for d in steps]) if len(steps) > 1 else steps[0].owners
        if ended:
            keep = torch.isin(owners, torch.tensor(ended, dtype=torch.int64), invert=True).nonzero().view(-1)
            self.rows_dropped += int(owners.numel()) - int(keep.numel())
            if keep.numel() == 0:
                return
            dev = keep.to(cache_loc.device, non_blocking=True)  # built on the host: no device sync to size it
            hidden, cache_loc, positions = (t.index_select(0, dev) for t in (hidden, cache_loc, positions))
            owners = owners.index_select(0, keep)
        if parked:
            # a parked row whose slot was taken since is stale: to the padding slot (no device sync to drop it)
            fresh = self._keeper_map(cache_loc).index_select(0, cache_loc) == owners.to(cache_loc.device,
                                                                                        non_blocking=True)
            cache_loc = torch.where(fresh, cache_loc, torch.zeros_like(cache_loc))
        n = int(cache_loc.numel())
        self._append(hidden.view(n, 1, -1), cache_loc.view(n, 1), positions.view(n, 1),
                     torch.ones(n, dtype=torch.int32, device=cache_loc.device))

    def _keeper_map(self, like: torch.Tensor) -> torch.Tensor:
        if self._keeper is None:
            self._keeper = torch.zeros(self._slots(), dtype=torch.int64, device=like.device)
        return self._keeper
