"""Tell the speculative worker about requests the scheduler ends outside the output stream (all devices).

SGLang 0.5.23 calls `draft_worker.note_request_finished` only for requests finished by a batch's result
(managers/scheduler_components/batch_result_processor.py). A request the scheduler ends itself -- aborted inside
`retract_decode` when even one request no longer fits, aborted while waiting (a retracted request re-queued, then
abort_request or a client disconnect), pushed out of a full queue -- is reported through
`Scheduler.send_abort_output` (managers/scheduler.py) and never reaches the worker, so the DFLASH_ADAPTIVE
controller kept its per-request state for good. Nor does a request that finishes in a prefill result
(`SchedulerBatchResultProcessor.process_batch_result_prefill`): a retracted request keeps its controller state
while re-queued, and one aborted while its re-prefill runs (SGLang's `to_finish`) ends there. This notifies the
worker on both paths as well (natural_stop False); a request the worker never saw is a no-op for it.

Every way a request leaves 0.5.23's scheduler (outside disaggregation) and what tells the worker: a decode result
(upstream); a prefill result -- a first prefill that already finishes it, a re-prefill after retraction, an abort
while running (`to_finish`) that a retraction turned into one -- (this patch); `send_abort_output` -- aborted
inside `retract_decode`, while queued (method 1 of `abort_request`, retracted requests included), during chunked
prefill, by a full queue or a refused priority -- (this patch). A request aborted while running ends in the next
decode or prefill result; waiting and running timeouts go through `abort_request`. A decode result whose
captured sampling support cannot be returned (`SchedulerBatchResultProcessor._handle_sampling_mask_abort`: support
over `--sampling-mask-max-tokens`, or the backend's mask missing or invalid) releases the request's KV itself and
skips the finish path that tells the worker (this patch; read from the source, not exercised by a test: the
speculative path admits `return_sampling_mask` only with a finite top_k within the limit, and ties at the cutoff --
forced with equal logit biases -- did not overflow it). Retired by:
upstream calling `note_request_finished` for every request that leaves the scheduler, results of any forward mode
or aborts.
"""
from __future__ import annotations

from types import ModuleType

from sglang_ext.patches.wrap import when_imported, wrap

SCHEDULER = "sglang.srt.managers.scheduler"
RESULTS = "sglang.srt.managers.scheduler_components.batch_result_processor"


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


def _patch_prefill(results: ModuleType) -> None:
    from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

    def make(original):
        def process_batch_result_prefill(self, batch, result):
            out = original(self, batch, result)
            worker = getattr(self, "draft_worker", None)
            if isinstance(worker, BaseSpecWorker):
                for req in batch.reqs:
                    if req.finished():
                        worker.note_request_finished(rid=req.rid, natural_stop=False)
            return out

        return process_batch_result_prefill

    wrap(results.SchedulerBatchResultProcessor, "process_batch_result_prefill", make)


def _patch_sampling_mask_abort(results: ModuleType) -> None:
    from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

    def make(original):
        def _handle_sampling_mask_abort(self, req) -> None:
            original(self, req)
            worker = getattr(self, "draft_worker", None)
            if isinstance(worker, BaseSpecWorker):
                worker.note_request_finished(rid=req.rid, natural_stop=False)

        return _handle_sampling_mask_abort

    wrap(results.SchedulerBatchResultProcessor, "_handle_sampling_mask_abort", make)


def install() -> None:
    when_imported(SCHEDULER, _patch)
    when_imported(RESULTS, _patch_prefill)
    when_imported(RESULTS, _patch_sampling_mask_abort)
