"""The speculative step's result copy skips upstream's profiler span unless a profiler records
(sglang_ext/patches/profiler_spans.py). Checked on SGLang's real GenerationBatchResult in a child process with the
CPU layer's import stubs: the method upstream decorates is still decorated (the patch's contract), the patched copy
emits no span without a profiler and the same `copy_result_to_cpu` span under one, and copies as before."""
from __future__ import annotations

from tests.conftest import child_result

PROBE = r"""
import json, torch
from sglang_ext.patches import profiler_spans
from sglang.srt.managers import utils as mu
upstream = mu.GenerationBatchResult.copy_to_cpu
decorated = getattr(upstream, "__wrapped__", None) is not None
profiler_spans.install()  # the module is imported: the patch applies now
patched = mu.GenerationBatchResult.copy_to_cpu

class Logits:  # a logits output with hidden states only (every other field unset)
    hidden_states = torch.ones(2, 3)
    def __getattr__(self, name):
        return None

class Result(mu.GenerationBatchResult):  # the fields copy_to_cpu reads; the rest unset
    def __init__(self):
        pass
    def __getattr__(self, name):
        return None

def result():
    r = Result()
    r.logits_output = Logits()
    r.copy_done = torch.get_device_module("cpu").Event()  # what the scheduler sets before the copy
    r.next_token_ids = torch.arange(2)
    return r

def spans(fn):
    with torch.profiler.profile() as prof:
        fn()
    return [e.name for e in prof.events() if e.name == "copy_result_to_cpu"]

plain = result()
patched(plain, return_logprob=False)  # no profiler: the undecorated body
out = {"decorated": decorated, "patched": patched is not upstream,
       "copied": torch.equal(plain.logits_output.hidden_states, torch.ones(2, 3)),
       "span_under_profiler": spans(lambda: patched(result(), return_logprob=False)),
       "upstream_span": spans(lambda: upstream(result(), return_logprob=False))}
import unittest.mock as m
with m.patch("torch.autograd.profiler.record_function.__enter__", side_effect=AssertionError("span entered")):
    patched(result(), return_logprob=False)
    out["no_span_without_profiler"] = True
print("RESULT" + json.dumps(out))
"""


def test_result_copy_emits_the_upstream_span_only_under_a_profiler():
    got = child_result("-c", PROBE)
    assert got["decorated"], "upstream no longer decorates copy_to_cpu: retire patches/profiler_spans.py"
    assert got["patched"] and got["copied"] and got["no_span_without_profiler"]
    assert got["span_under_profiler"] == got["upstream_span"] == ["copy_result_to_cpu"]
