"""Penalties in one fixed order in every process: additive (frequency, presence, min_new_tokens), then scaling
(repetition) -- all devices, every algorithm.

SGLang 0.5.23 (`sampling/penaltylib/orchestrator.BatchedPenalizerOrchestrator.__init__`) keeps its penalizers in a
dict built from a *set* of classes, and the non-overlap sampler applies them in that dict's order
(`BatchedPenalizerOrchestrator.apply`). A set of classes iterates in hash order, and a class hashes by its address,
so the order changes from one server start to the next: with repetition_penalty and frequency/presence penalties
together, plain greedy decoding of the same request returned different tokens after a restart (found through the
server: `PROMPTS[2]` of tests/conftest.py, repetition 1.2 + frequency 0.5 + presence 0.5, 48 tokens: token 36
differed on 2 of 6 restarts over two measurements; dividing a logit by 1.2 before or after subtracting 1.0 is not
the same).
The overlap scheduler's path already applies the accumulated additive penalties, then the scaling ones; this makes
the non-overlap path do the same, so a request's output does not depend on the process, and DFlash's per-row
replay (sglang_ext/verify_rows.py, the same order) equals plain decoding.
Retired by: upstream keeping its penalizers in a fixed order (a list, or additive-then-multiplicative as the
overlap path does).
"""
from __future__ import annotations

from types import ModuleType

from sglang_ext.patches.wrap import when_imported, wrap


def fixed_order(penalizers) -> list:
    """Additive penalizers first, then multiplicative ones; by class name within each (stable across processes)."""
    return sorted(penalizers, key=lambda cls: (bool(getattr(cls, "is_multiplicative", False)), cls.__name__))


def _patch(orchestrator: ModuleType) -> None:
    def make(original):
        def __init__(self, vocab_size, batch, penalizers):
            original(self, vocab_size, batch, fixed_order(penalizers))

        return __init__

    wrap(orchestrator.BatchedPenalizerOrchestrator, "__init__", make)


def install() -> None:
    when_imported("sglang.srt.sampling.penaltylib.orchestrator", _patch)
