"""Publish the scheduler's gauges as soon as it goes idle (all devices).

SGLang 0.5.23 (managers/scheduler_components/metrics_reporter.py `_maybe_log_idle_metrics`) refreshes the idle
gauges at once only when `sglang:num_running_reqs` disagrees with the running batch; otherwise every 30 s. After
a burst of requests that ended (or were aborted by disconnecting clients) before a decode-stats publish moved the
running gauge off 0, `sglang:num_used_tokens`, `sglang:kv_used_tokens`, `sglang:token_usage` and
`sglang:num_queue_reqs` kept their busy values for up to 30 s: on a dashboard, exactly what a request leaking KV
cache looks like (SGLang issue 36333). This forces one idle publish on the first idle pass after any publish made
while busy -- SGLang's own idiom for pauses (`last_log_time = 0.0` before `_maybe_log_idle_metrics`, scheduler.py).
One extra publish per busy-to-idle transition; the 30 s idle cadence is unchanged.
"""
from __future__ import annotations

from types import ModuleType

from sglang_ext.patches.wrap import when_imported, wrap

def _patch(mr: ModuleType) -> None:
    def make(original):
        def _maybe_log_idle_metrics(self):
            collector = getattr(self, "metrics_collector", None)
            if collector is None or not getattr(self, "current_scheduler_metrics_enabled", False):
                return original(self)
            if getattr(self, "_dflash_idle_published_at", None) != collector.last_log_time:
                collector.last_log_time = 0.0  # the last publish was a busy one: publish the idle gauges now
            original(self)
            self._dflash_idle_published_at = collector.last_log_time

        return _maybe_log_idle_metrics

    wrap(mr.SchedulerMetricsReporter, "_maybe_log_idle_metrics", make)


def install() -> None:
    when_imported("sglang.srt.managers.scheduler_components.metrics_reporter", _patch)
