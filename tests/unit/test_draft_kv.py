"""DraftKV: deferred draft-KV appends (width-1 steps, a prefill's prompt context) reach the draft KV before a draft
reads them; a request that leaves has its rows dropped (no prefix cache) or parked until the next decode step (never
on a prefill, never over a later owner of their slots); no pass writes a slot twice. The writer is a recorder; the
rules are the product's."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_ext.steps import draft_kv
from sglang_ext.steps.draft_kv import DraftKV

D = 4
SINK = 0  # SGLang's padding slot: never a request's


class Req:
    """The fields of SGLang's Req that DraftKV reads."""

    def __init__(self, rid: str, pool_idx: int) -> None:
        self.rid, self.kv, self.is_retracted, self.finished_reason = rid, SimpleNamespace(req_pool_idx=pool_idx), \
            False, None

    def finished(self) -> bool:
        return self.finished_reason is not None


class Recorder:
    def __init__(self) -> None:
        self.passes: list[dict[int, tuple[int, float]]] = []  # per pass: slot -> (position, feature)
        self.sunk = 0  # rows written to the padding slot (stale)

    def __call__(self, *, target_hidden, cache_loc, positions, **_) -> None:
        slots = cache_loc.tolist()
        real = [s for s in slots if s != SINK]
        assert len(set(real)) == len(real), "a pass wrote a slot twice"
        self.passes.append({s: (int(p), float(h[0])) for s, p, h in zip(slots, positions.tolist(), target_hidden)
                            if s != SINK})
        self.sunk += len(slots) - len(real)

    def written(self) -> dict[int, tuple[int, float]]:
        out: dict[int, tuple[int, float]] = {}
        for p in self.passes:
            out.update(p)
        return out


def rows(slots: list[int], start_pos: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Features equal to the slot id (so what was written where is checkable), consecutive positions."""
    s = torch.tensor(slots)
    return s.float().view(-1, 1).expand(-1, D).clone(), s, torch.arange(start_pos, start_pos + len(slots))


def kv(keep_left: bool = True, defers: bool = True) -> tuple[DraftKV, Recorder]:
    rec = Recorder()
    return DraftKV(rec, compact=True, defers=defers, slots=lambda: 256, keep_left=keep_left), rec


def test_prompt_contexts_and_width1_rows_wait_for_the_next_draft_and_arrive_whole() -> None:
    d, rec = kv()
    a, b = Req("a", 0), Req("b", 1)
    assert d.defer_prompt(*rows([10, 11, 12, 20, 21]), [a, b], [3, 2])  # one prefill of two prompts
    d.defer(*rows([13, 22], 3), [a, b])  # a width-1 step
    d.before_forward(decode=False)  # both still own their slots: nothing written
    d.end_width1_step()
    assert rec.passes == [] and d.pending_rows == 7
    d.flush()  # before a draft
    assert len(rec.passes) == 1 and sorted(rec.written()) == [10, 11, 12, 13, 20, 21, 22]
    assert all(feat == slot for slot, (_, feat) in rec.written().items())
    assert d.pending_rows == 0


def test_without_a_prefix_cache_a_left_requests_rows_are_never_written_and_the_others_keep_waiting() -> None:
    d, rec = kv(keep_left=False)
    a, b = Req("a", 0), Req("b", 1)
    d.defer_prompt(*rows([10, 11, 20]), [a, b], [2, 1])
    d.defer(*rows([12, 21], 2), [a, b])
    a.finished_reason = "stop"  # a leaves: its slots 10-12 may be handed to the next prefill
    d.before_forward(decode=False)
    assert rec.written() == {}  # b's rows still wait; a's are nobody's
    c = Req("c", 0)  # takes a's request-pool row and slots
    d.defer_prompt(*rows([10, 11]), [c], [2])
    d.flush()
    assert rec.written() == {10: (0, 10.0), 11: (1, 11.0), 20: (2, 20.0), 21: (3, 21.0)}  # c's rows and b's
    assert d.rows_dropped == 3 and d.pending_rows == 0


def test_a_readmitted_request_keeps_its_new_rows_and_loses_its_old_ones() -> None:
    """Retracted and admitted again under the same request id: the rows kept before are its old slots', never
    written; the rows kept since are its own."""
    d, rec = kv(keep_left=False)
    a = Req("a", 0)
    d.defer(*rows([10]), [a])
    a.kv = SimpleNamespace(req_pool_idx=5)  # re-admitted: a new KV record, new slots
    d.before_forward(decode=False)
    d.defer(*rows([50], 7), [a])
    d.flush()
    assert rec.written() == {50: (7, 50.0)} and d.rows_dropped == 1


def test_with_a_prefix_cache_a_request_that_leaves_is_written_after_the_next_prefill_never_before_it() -> None:
    """Its slots may live on in the prefix cache, where a later request's draft reads them: written before the first
    decode step after a prefill (with every pending row), never before a prefill -- the request that follows it in
    a closed loop does not wait for them."""
    d, rec = kv(keep_left=True)
    a, b = Req("a", 0), Req("b", 1)
    d.defer_prompt(*rows([10, 11, 20]), [a, b], [2, 1])
    d.defer(*rows([12, 21], 2), [a, b])
    a.finished_reason = "stop"
    d.before_forward(decode=True)  # b decodes on; the next request has not arrived
    assert rec.passes == []
    d.before_forward(decode=False)  # a prefill
    c = Req("c", 2)
    d.defer_prompt(*rows([30, 31]), [c], [2])
    assert rec.passes == [] and d.pending_rows == 7
    d.before_forward(decode=True)
    assert len(rec.passes) == 1 and d.pending_rows == 0 and d.rows_dropped == 0
    assert rec.written() == {10: (0, 10.0), 11: (1, 11.0), 12: (2, 12.0), 20: (2, 20.0), 21: (3, 21.0),
                             30: (0, 30.0), 31: (1, 31.0)}
    d.before_forward(decode=True)
    assert len(rec.passes) == 1  # written once


@pytest.mark.parametrize("taken_by", ["a prompt kept", "a width-1 row kept", "a prompt written at once",
                                      "a draft step's append"])
def test_a_parked_row_whose_slot_was_handed_on_is_never_written_over_its_new_owner(taken_by: str) -> None:
    """The cache evicted a parked request's slot and the allocator handed it on: the new owner's row stands."""
    d, rec = kv(keep_left=True)
    a = Req("a", 0)
    d.defer_prompt(*rows([10, 11, 12]), [a], [3])
    a.finished_reason = "stop"
    d.before_forward(decode=False)
    c = Req("c", 0)
    new = (torch.full((1, D), 99.0), torch.tensor([11]), torch.tensor([40]))  # slot 11 is c's now
    if taken_by == "a prompt kept":
        d.defer_prompt(*new, [c], [1])
    elif taken_by == "a width-1 row kept":
        d.defer(*new, [c])
    elif taken_by == "a prompt written at once":
        d.written(new[1])
        rec(target_hidden=new[0], cache_loc=new[1], positions=new[2])
    else:
        d.append(new[0].view(1, 1, D), new[1].view(1, 1), new[2].view(1, 1), torch.ones(1, dtype=torch.int32))
    d.flush()
    assert rec.written() == {10: (0, 10.0), 11: (40, 99.0), 12: (2, 12.0)}
    assert rec.sunk == 1 and d.pending_rows == 0


def test_parked_rows_are_written_with_the_rest_at_the_byte_bound(monkeypatch) -> None:
    monkeypatch.setattr(draft_kv, "DEFERRED_APPEND_BYTES", 4 * D * 4)  # four float32 rows
    d, rec = kv(keep_left=True)
    a, b = Req("a", 0), Req("b", 1)
    d.defer_prompt(*rows([10, 11, 12]), [a], [3])
    a.finished_reason = "stop"
    d.before_forward(decode=False)
    d.defer(*rows([20]), [b])
    d.end_width1_step()  # four rows held: written, a's among them
    assert sorted(rec.written()) == [10, 11, 12, 20] and d.pending_rows == 0


@pytest.mark.parametrize("how", ["retracted", "readmitted"])
def test_a_retracted_or_readmitted_request_no_longer_owns_its_rows(how: str) -> None:
    """Its old rows are parked (its prefix may be cached) and written before the decode step after a prefill."""
    d, rec = kv()
    a = Req("a", 0)
    d.defer(*rows([10]), [a])
    if how == "retracted":
        a.is_retracted = True
    else:
        a.kv = SimpleNamespace(req_pool_idx=5)  # a new KV record: new slots
    d.before_forward(decode=False)
    assert rec.passes == [] and d.pending_rows == 1
    d.before_forward(decode=True)
    assert rec.written() == {10: (0, 10.0)} and d.pending_rows == 0


def test_a_prompt_past_the_row_bound_or_with_deferring_off_is_left_to_the_caller(monkeypatch) -> None:
    monkeypatch.setattr(draft_kv, "DEFERRED_APPEND_BYTES", 4 * D * 4)  # four float32 rows
    d, _ = kv()
    a, b = Req("a", 0), Req("b", 1)
    assert d.defer_prompt(*rows([1, 2, 3]), [a], [3])
    assert not d.defer_prompt(*rows([4, 5]), [b], [2])  # 5 rows would be held
    off, _ = kv(defers=False)
    assert not off.defer_prompt(*rows([1]), [a], [1])


def test_width1_rows_wait_for_a_draft_however_many_steps_until_the_byte_bound(monkeypatch) -> None:
    """A request at width 1 for many steps pays no append until something drafts (or it leaves); only the byte
    bound flushes a long stretch, in one pass."""
    monkeypatch.setattr(draft_kv, "DEFERRED_APPEND_BYTES", 40 * D * 4)  # forty float32 rows
    d, rec = kv()
    a = Req("a", 0)
    for i in range(39):
        d.defer(*rows([100 + i], i), [a])
        d.end_width1_step()
    assert rec.passes == [] and d.pending_rows == 39
    d.defer(*rows([139], 39), [a])
    d.end_width1_step()
    assert len(rec.passes) == 1 and sorted(rec.passes[0]) == list(range(100, 140)) and d.pending_rows == 0
