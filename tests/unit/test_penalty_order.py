"""Penalties apply in one order in every process (sglang_ext/patches/penalty_order.py): SGLang kept its penalizers
in set order, which follows class addresses, so plain greedy output with repetition and frequency/presence
penalties together changed from one server start to the next. Checked on SGLang's real orchestrator, in a child
process with the CPU layer's import stubs, for every order the penalizers can be handed over in."""
from __future__ import annotations

from tests.conftest import child_result

PROBE = r"""
import itertools, json
from sglang_ext.patches import penalty_order
penalty_order.install()
from sglang.srt.sampling import penaltylib
from sglang.srt.sampling.penaltylib.orchestrator import BatchedPenalizerOrchestrator

class Batch:  # what the orchestrator reads of a batch: its device and requests (none: nothing to prepare)
    device, reqs = "cpu", []

classes = [penaltylib.BatchedFrequencyPenalizer, penaltylib.BatchedMinNewTokensPenalizer,
           penaltylib.BatchedPresencePenalizer, penaltylib.BatchedRepetitionPenalizer]
batch = Batch()
orders = {tuple(type(p).__name__ for p in BatchedPenalizerOrchestrator(
              vocab_size=8, batch=batch, penalizers=set(perm) if i % 2 else list(perm)).penalizers.values())
          for i, perm in enumerate(itertools.permutations(classes))}
print("RESULT" + json.dumps(sorted(orders)))
"""


def test_penalizers_apply_additive_then_scaling_whatever_order_they_come_in():
    assert child_result("-c", PROBE) == [["BatchedFrequencyPenalizer", "BatchedMinNewTokensPenalizer",
                                                 "BatchedPresencePenalizer", "BatchedRepetitionPenalizer"]]
