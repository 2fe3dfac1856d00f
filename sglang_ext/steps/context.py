"""What every decode step kind reads: the step's inputs, and the verify width upstream's accept reads."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

if TYPE_CHECKING:
    from sglang_ext.controller.policy import Decision
    from sglang_ext.steps.upstream_surface import StepWorker, UpstreamWorker


@dataclass(frozen=True)
class StepContext:
    """One decode step: the worker (its upstream buffers and methods, each listed with its type in
    upstream_surface.py), SGLang's batch and its request ids, the controller's decision, the batch's draft state
    (upstream's DFlashDraftInputV2), its size and SGLang's callbacks."""

    worker: StepWorker
    batch: Any
    rids: list[str]
    decision: Decision
    draft_input: Any
    bs: int
    on_publish: Callable[[torch.Tensor], None] | None
    grammar_barrier: Any


@contextlib.contextmanager
def block_size_as(worker: UpstreamWorker, width: int) -> Iterator[None]:
    """Upstream's DFlashWorkerV2 reads ``self.block_size`` as the verify width in its accept and sizes its accept
    buffers by it: ``width`` inside, what it was after. Everywhere else it stays the trained block B."""
    saved, worker.block_size = worker.block_size, width
    try:
        yield
    finally:
        worker.block_size = saved
