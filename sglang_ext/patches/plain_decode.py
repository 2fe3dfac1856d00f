"""Width-1 steps scheduled, run and processed as plain decode steps (DFLASH_ADAPTIVE under the non-overlap scheduler).

SGLang 0.5.23 serves every decode step of a speculative batch through its speculative path: the decode preparation
reserves 2 x the block's KV per request (`spec_utils.spec_prepare_for_decode` from `ScheduleBatch.prepare_for_decode`),
the forward runs inside `Scheduler._forward_isolation`, which snapshots every field of the batch, and the result goes
through the accepted-run bookkeeping (`SchedulerBatchResultProcessor._resolve_spec_v2_tokens`). A step that drafts
nothing (the adaptive worker at width 1) pays all of it for one token, which plain decoding serves without. Three
call sites let such a step be a plain decode step (sglang_ext/steps/plain.py has the contract):

  * `Scheduler.update_running_batch`: while it runs, its `ScheduleBatch.prepare_for_decode` (its last call, after
    retraction) asks the worker for the step's decision first (`prepare_decode`); width 1 on a batch plain decoding
    serves alike makes the batch a plain decode batch there (`steps.plain.prepare_plain`) instead of reserving a
    block. Only this call site: the mixed-chunk preparation in `get_new_batch_prefill` keeps the speculative path;
    and only without overlap scheduling, pipeline stages or disaggregation.
  * `Scheduler.run_batch` needs nothing: a batch without a speculative algorithm takes its plain branch, which calls
    the same worker (`AdaptiveDFlashWorker.forward_batch_generation` recognises the batch and runs
    `steps.plain.decode_plain`).
  * `Scheduler.process_batch_result`: the plain result processing, bracketed by the worker's `before_plain_result`
    (speculative counters, the controller's feedback: upstream's speculative processing calls
    `on_verify_complete_cpu`) and `after_plain_result` (the batch speculative again, whatever the processing
    raised).

Retired by: upstream letting a speculative worker run a decode step as plain decoding (a per-step opt-out of the
speculative preparation and result path), or a speculative path whose width-1 step costs what a plain step costs.
"""
from __future__ import annotations

from types import ModuleType

from sglang_ext.patches.wrap import when_imported, wrap

_preparing: list = []  # the worker whose scheduler is inside update_running_batch (one per process)
PLAIN_ATTR = "dflash_serve_plain"  # on a ScheduleBatch for one iteration: the speculative algorithm it set aside


def _worker(scheduler):
    worker = getattr(scheduler, "draft_worker", None)
    return worker if hasattr(worker, "prepare_decode") else None


def _patch_batch(schedule_batch: ModuleType) -> None:
    def make(original):
        def prepare_for_decode(self):
            if _preparing and not self.spec_algorithm.is_none() and self.batch_size() > 0:
                if _preparing[-1].prepare_decode(self):  # prepared as a plain decode batch
                    return None
            return original(self)

        return prepare_for_decode

    wrap(schedule_batch.ScheduleBatch, "prepare_for_decode", make)


def _patch_scheduler(scheduler: ModuleType) -> None:
    def make_update(original):
        def update_running_batch(self, batch):
            worker = _worker(self)
            # the plain path of one scheduler, one pipeline stage, no disaggregation: the others relay or rebuild
            # speculative state between stages and servers
            if (worker is None or self.enable_overlap or self.pp_group.world_size > 1
                    or getattr(self.disaggregation_mode, "value", "null") != "null"):
                return original(self, batch)
            _preparing.append(worker)
            try:
                return original(self, batch)
            finally:
                _preparing.pop()

        return update_running_batch

    def make_process(original):
        def process_batch_result(self, batch, result):
            worker = _worker(self)
            if getattr(batch, PLAIN_ATTR, None) is None or worker is None:
                return original(self, batch, result)
            worker.before_plain_result(self, batch)
            try:
                return original(self, batch, result)
            finally:
                worker.after_plain_result(batch, result)

        return process_batch_result

    wrap(scheduler.Scheduler, "update_running_batch", make_update)
    wrap(scheduler.Scheduler, "process_batch_result", make_process)


def install() -> None:
    when_imported("sglang.srt.managers.schedule_batch", _patch_batch)
    when_imported("sglang.srt.managers.scheduler", _patch_scheduler)
