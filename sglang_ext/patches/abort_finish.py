"""Tell the speculative worker about requests the scheduler ends outside the output stream (all devices).

SGLang 0.5.23 calls `draft_worker.note_request_finished` only for requests finished by a batch's result
(managers/scheduler_components/batch_result_processor.py). A request the scheduler ends itself -- aborted inside
`retract_decode` when even one request no longer fits, aborted while waiting (a retracted request re-queued, then
abort_request or a client disconnect), pushed out of a full queue -- is reported through
`Scheduler.send_abort_output` (managers/scheduler.py) and never reaches the worker, so the DFLASH_ADAPTIVE
controller kept its per-request state for good. This notifies the worker there as well (natural_stop False);
a request the worker never saw is a no-op for it. Retired by: upstream calling `note_request_finished` for every
request that leaves the scheduler, results or aborts.
"""
from __future__ import annotations

from types import ModuleType

from sglang_ext.patches.wrap import when_imported, wrap

SCHEDULER = "sglang.srt.managers.scheduler"


def _patch(scheduler: ModuleType) -> None:
    from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

    def make(original):
        def send_abort_output(self, abort_req, req) -> None:
            original(self, abort_req, req)
            worker = getattr(self, "draft_worker", None)
            if req is not None and isinstance(worker, BaseSpecWorker):
                worker.note_request_finished(rid=req.rid, natural_stop=False)

        return send_abort_output

    wrap(scheduler.Scheduler, "send_abort_output", make)


def install() -> None:
    when_imported(SCHEDULER, _patch)
