"""Hand finished requests' token ids to the capture store (all devices; only with the `learning:` section on).

Patches (0.5.23): `managers/scheduler_components/batch_result_processor.SchedulerBatchResultProcessor.
_handle_finish_state_updated_req`, the one place a decode result finishes a request with its prompt and committed
output ids at hand (the same call site upstream tells the speculative worker from). Why: SGLang has no hook for a
finished request's tokens in the scheduler process, and the tokenizer side sees text and streams. The handover is
a non-blocking queue put (`sglang_ext/capture.py CaptureWriter.offer`): the scheduler never waits on the disk.
Skipped: aborted requests, requests that opted out (`custom_params: {"dflash_capture": false}`), and those that
finished in their prefill (nothing decoded to learn from). Retired by: an upstream request-finished callback
carrying the request's token ids.
"""
from __future__ import annotations

import logging
from types import ModuleType

from sglang_ext.patches.wrap import when_imported, wrap
from sglang_ext.settings import CAPTURE_OPT_OUT_KEY, CaptureSettings

logger = logging.getLogger(__name__)
RESULTS = "sglang.srt.managers.scheduler_components.batch_result_processor"
_writer = None


def writer():
    """This process's writer (created at the first finished request), or None when capture is off."""
    global _writer
    if _writer is None:
        settings = CaptureSettings.from_env()
        if settings is None:
            return None
        from sglang_ext.capture import CaptureWriter

        _writer = CaptureWriter(settings)
        logger.info("dflash-serve capture on: store %s, %d MB, %.0f h", settings.store_dir,
                    settings.max_store_bytes // (1024 * 1024), settings.max_age_seconds / 3600)
    return _writer


def opted_out(req) -> bool:
    params = getattr(req.sampling_params, "custom_params", None)
    return isinstance(params, dict) and params.get(CAPTURE_OPT_OUT_KEY) is False


def _sampled(req) -> bool:
    sp = req.sampling_params
    return sp.temperature > 0 and sp.top_k != 1


def _patch(results: ModuleType) -> None:
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.runtime_context import get_parallel

    def rank0() -> bool:  # every TP rank processes the same results: one writes
        return int(get_parallel().tp_rank) == 0

    def make(original):
        def _handle_finish_state_updated_req(self, req, batch, result, i, logits_output):
            out = original(self, req, batch, result, i, logits_output)
            if req.finished() and not isinstance(req.finished_reason, FINISH_ABORT) and not opted_out(req) \
                    and rank0():
                w = writer()
                if w is not None and len(req.output_ids) > 1:  # the ids the client got: past a stop or max_new_tokens cut
                    w.offer(req.origin_input_ids, req.output_ids_through_stop, _sampled(req))
            return out

        return _handle_finish_state_updated_req

    wrap(results.SchedulerBatchResultProcessor, "_handle_finish_state_updated_req", make)


def install() -> None:
    if CaptureSettings.from_env() is not None:  # off: upstream's call site stays untouched
        when_imported(RESULTS, _patch)
