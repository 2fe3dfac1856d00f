"""Upstream's result-copy profiler span only while a torch profiler records (all devices).

SGLang 0.5.23 (managers/utils.py) decorates `GenerationBatchResult.copy_to_cpu` with
`torch.profiler.record_function("copy_result_to_cpu")`; the speculative scheduler path calls it once per decode step
(scheduler.py `run_batch`; plain decoding relays through the future map instead). The span's enter/exit are two
dispatcher ops whether or not a profiler runs: a cost every speculative step pays and plain decoding does not
(docs/BENCHMARKS.md, benchmarks/step_profile.py). This calls the undecorated method unless a
profiler is recording, when the span is kept as upstream emits it.
Retired by: upstream emitting the span only under an active profiler (as its nvtx gates do).
"""
from __future__ import annotations

from types import ModuleType

from sglang_ext.patches.wrap import when_imported, wrap


def _patch(mu: ModuleType) -> None:
    import torch

    if getattr(mu.GenerationBatchResult.copy_to_cpu, "__wrapped__", None) is None:
        return  # not the decorated method this patch knows (no span to skip): leave it as it is
    recording = torch._C._autograd._profiler_enabled  # the C++ profiler state (any torch profiler; one cheap call)

    def make(original):
        plain = original.__wrapped__

        def copy_to_cpu(self, *args, **kwargs):
            if recording():
                return original(self, *args, **kwargs)
            return plain(self, *args, **kwargs)

        return copy_to_cpu

    wrap(mu.GenerationBatchResult, "copy_to_cpu", make)


def install() -> None:
    when_imported("sglang.srt.managers.utils", _patch)
