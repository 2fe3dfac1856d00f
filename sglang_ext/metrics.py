"""Prometheus metrics of the DFLASH_ADAPTIVE worker (names are a contract: docs/ARCHITECTURE.md §4).

Where they live: in the scheduler process, created lazily by the worker on TP rank 0 when SGLang runs with
``--enable-metrics``. By then SGLang has set ``PROMETHEUS_MULTIPROC_DIR`` for its process tree, so
prometheus_client writes them to the shared mmap directory and the HTTP server's MultiProcessCollector serves
them at ``/metrics`` next to SGLang's own. Importing prometheus_client any earlier (e.g. when the plugin is
registered in the main process, before the variable is set) would fix its value class to in-process values and
drop SGLang's own metrics; that is why nothing here runs at import time of the plugin.

Every series carries ``model_name``. Gauges use ``multiprocess_mode="mostrecent"`` (one writer: rank 0).

Counters (all per TP-rank-0 scheduler; ``rate()`` them). Width-1 steps reach them at most WIDTH1_FLUSH_STEPS steps
late (and before another width's step or a finished request's answer):
  dflash_verify_steps_total               request-steps verified (one per request per decode step).
                                          Decode steps/s per request: rate(dflash_verify_steps_total[1m])
  dflash_draft_tokens_total               draft tokens offered to the verifier (b - 1 per request-step; a tree
                                          of width b: its b - 1 nodes).
                                          Acceptance rate under variable width (use this, not
                                          sglang:spec_accept_rate, whose denominator assumes the full block):
                                          rate(dflash_accepted_tokens_total[1m]) / rate(dflash_draft_tokens_total[1m])
  dflash_accepted_tokens_total            draft tokens accepted.
                                          Mean acceptance length (tokens committed per request-step):
                                          1 + rate(dflash_accepted_tokens_total[1m]) / rate(dflash_verify_steps_total[1m])
  dflash_accepted_tokens_by_position_total{position}
                                          draft tokens accepted at position j (1-based after the anchor).
  dflash_tried_tokens_by_position_total{position}
                                          draft tokens verified at position j with positions < j accepted, i.e.
                                          the chances position j had. Realised conditional acceptance p_j:
                                          rate(dflash_accepted_tokens_by_position_total[5m])
                                            / rate(dflash_tried_tokens_by_position_total[5m])
  dflash_block_size_steps_total{block_size}
                                          decode steps (batches) run at verify width b (the step's shape: above
                                          the drafter's block a DDTree of b - 1 prefixes). Share of steps:
                                          sum by (block_size) (rate(dflash_block_size_steps_total[5m]))
                                            / ignoring(block_size) group_left sum(rate(dflash_block_size_steps_total[5m]))
  dflash_block_size_switches_total        decisions that changed b. Flapping: rate(dflash_block_size_switches_total[5m])
  dflash_controller_errors_total          controller feedback failures (logged; serving continues at the last b).
  dflash_probe_steps_total{block_size}    steps at width b that drafted the full block only to observe acceptance (the
                                          controller's probes: at b = 1 a draft forward speculation-off pays; with
                                          prefix drafts (CPU) a full draft where b positions would do). Share of the
                                          steps at each width:
                                          sum by (block_size) (rate(dflash_probe_steps_total[5m]))
                                            / sum by (block_size) (rate(dflash_block_size_steps_total[5m]))
  dflash_tree_steps_total{budget}         decode steps that verified a DDTree of `budget` draft prefixes (verify width
                                          budget + 1 > the drafter's block). Share of the steps:
                                          sum(rate(dflash_tree_steps_total[5m])) / sum(rate(dflash_block_size_steps_total[5m]))
  dflash_tree_extra_tokens_total{budget}  tokens tree steps committed past the point where the greedy chain of the same
                                          draft stopped agreeing (what the tree bought). Extra tokens per request-step:
                                          sum(rate(dflash_tree_extra_tokens_total[5m])) / sum(rate(dflash_verify_steps_total[5m]))
Gauges:
  dflash_block_size                       verify width of the latest decode step.
  dflash_predicted_goodput_tokens_per_second
                                          the controller's predicted committed tokens/s of the batch at its choice.
                                          Realised: rate(sglang:generation_tokens_total[1m]); ratio = model error.
  dflash_acceptance_probability{position} the controller's global p_j (hindsight-corrected, not censored by b).
  dflash_step_cost_seconds{batch_bucket,block_size}
                                          the active step-cost table T(B, b) the controller decides with.
  dflash_tree_expected_extra_tokens{budget}
                                          the controller's learned tokens per request-step a tree of `budget`
                                          prefixes commits past chain B's (negative: the tree's budget misses the
                                          chain's deep end); a tree is chosen when chain B's tokens plus this, over
                                          its step cost, beat every other width.
Histograms:
  dflash_step_seconds{block_size}         wall time of one decode step, start to start of consecutive decode steps
                                          (draft + verify + draft-KV append + SGLang's result processing).
                                          p50: histogram_quantile(0.5, sum by (le, block_size) (rate(dflash_step_seconds_bucket[5m])))
  dflash_committed_tokens_per_step        tokens committed per request-step (accepted + 1).
                                          mean: rate(dflash_committed_tokens_per_step_sum[1m]) / rate(dflash_committed_tokens_per_step_count[1m])
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

# Width-1 steps (speculation off) are counted in process and written at most this many steps late (also before any
# other step, and when a request finishes: SGLang reports a finished request after its last step's feedback, so a
# client that got its answer sees every step of it). Why: their ~8 multiprocess-mmap writes cost ~95 us of every
# width-1 step in a CPU server (cache-cold, measured in situ at 1 request: ~1 % of the step).
WIDTH1_FLUSH_STEPS = 16

_STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.0, 2.0, 4.0, 8.0)


class DFlashMetrics:
    """The worker's metric families, children pre-resolved so a step costs a few dict-free increments."""

    def __init__(self, model_name: str, max_block: int, candidates: Sequence[int], registry=None) -> None:
        """``candidates``: the verify widths in use (above ``max_block``: trees of width - 1 prefixes)."""
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram

        registry = REGISTRY if registry is None else registry

        labels = {"model_name": model_name}
        names = ["model_name"]
        self.max_block = int(max_block)
        positions = [str(j) for j in range(1, self.max_block)]

        def counter(name, doc, extra=()):
            return Counter(name, doc, names + list(extra), registry=registry)

        def gauge(name, doc, extra=()):
            return Gauge(name, doc, names + list(extra), multiprocess_mode="mostrecent", registry=registry)

        self.verify_steps = counter("dflash_verify_steps", "Request-steps verified").labels(**labels)
        self.draft_tokens = counter("dflash_draft_tokens", "Draft tokens offered to the verifier").labels(**labels)
        self.accepted = counter("dflash_accepted_tokens", "Draft tokens accepted").labels(**labels)
        by_pos = counter("dflash_accepted_tokens_by_position", "Draft tokens accepted at position j", ["position"])
        tried = counter("dflash_tried_tokens_by_position",
                        "Draft tokens verified at position j with every earlier position accepted", ["position"])
        self.accepted_by_pos = [by_pos.labels(position=p, **labels) for p in positions]
        self.tried_by_pos = [tried.labels(position=p, **labels) for p in positions]
        steps = counter("dflash_block_size_steps", "Decode steps run at verify width b", ["block_size"])
        self.block_steps = {b: steps.labels(block_size=str(b), **labels) for b in candidates}
        self.switches = counter("dflash_block_size_switches", "Verify-width changes").labels(**labels)
        self.errors = counter("dflash_controller_errors", "Controller feedback failures").labels(**labels)
        probes = counter("dflash_probe_steps", "Steps that drafted the full block only to observe acceptance",
                         ["block_size"])
        self.probes = {b: probes.labels(block_size=str(b), **labels) for b in candidates}
        tree_steps = counter("dflash_tree_steps", "Decode steps that verified a DDTree", ["budget"])
        tree_extra = counter("dflash_tree_extra_tokens", "Tokens tree steps committed past the greedy chain's agreement",
                             ["budget"])
        budgets = [int(b) - 1 for b in candidates if b > self.max_block]
        self.tree_steps = {n: tree_steps.labels(budget=str(n), **labels) for n in budgets}
        self.tree_extra = {n: tree_extra.labels(budget=str(n), **labels) for n in budgets}
        gain = gauge("dflash_tree_expected_extra_tokens",
                     "Controller's learned tokens per request-step a tree commits past chain B's", ["budget"])
        self.tree_gain = [gain.labels(budget=str(n), **labels) for n in budgets]
        self.block_size = gauge("dflash_block_size", "Verify width of the latest decode step").labels(**labels)
        self.goodput = gauge("dflash_predicted_goodput_tokens_per_second",
                             "Predicted committed tokens/s of the batch at the chosen width").labels(**labels)
        p = gauge("dflash_acceptance_probability", "Controller's global conditional acceptance p_j", ["position"])
        self.p = [p.labels(position=pos, **labels) for pos in positions]
        self._cost = gauge("dflash_step_cost_seconds", "Active step-cost table T(B, b)", ["batch_bucket", "block_size"])
        self._labels = labels
        step_seconds = Histogram("dflash_step_seconds", "Decode step wall time", names + ["block_size"],
                                 buckets=_STEP_BUCKETS, registry=registry)
        self.step_seconds = {b: step_seconds.labels(block_size=str(b), **labels) for b in candidates}
        self.committed = Histogram("dflash_committed_tokens_per_step", "Tokens committed per request-step", names,
                                   buckets=tuple(float(k) for k in range(1, self.max_block + 1)),
                                   registry=registry).labels(**labels)
        self._last_block: int | None = None
        self._w1_steps = 0  # width-1 steps counted, not yet written (flush)
        self._w1_requests = 0  # and their request-steps
        self._w1_goodput = 0.0  # the latest one's predicted goodput

    def flush(self) -> None:
        """Write the width-1 steps counted since the last write (WIDTH1_FLUSH_STEPS)."""
        if not self._w1_steps:
            return
        steps, requests = self._w1_steps, self._w1_requests
        self._w1_steps = self._w1_requests = 0
        self.verify_steps.inc(requests)
        self.block_steps[1].inc(steps)
        self.goodput.set(self._w1_goodput)
        observe_counts(self.committed, np.array([0, requests]))  # each committed one token

    def record_step(self, *, block_size: int, switched: bool, accepted: np.ndarray, predicted_goodput: float,
                    probe: bool = False, tree_budget: int | None = None, tree_extra: int = 0) -> None:
        """One verified decode step. ``accepted``: draft tokens accepted per request (int array); ``probe``: the step
        drafted the full block only to observe acceptance (``Decision.probe``); ``tree_budget``: the step verified a
        tree of that many nodes (width ``block_size`` = budget + 1), committing ``tree_extra`` tokens past the
        greedy chain's."""
        b = int(block_size)
        if b == 1 and self._last_block == 1 and not (probe or switched or tree_budget is not None):
            self._w1_steps += 1
            self._w1_requests += int(accepted.shape[0])  # a width-1 step accepts nothing
            self._w1_goodput = predicted_goodput
            if self._w1_steps >= WIDTH1_FLUSH_STEPS:
                self.flush()
            return
        self.flush()
        if probe:
            self.probes[b].inc()
        n = int(accepted.shape[0])
        total = int(accepted.sum())
        self.verify_steps.inc(n)
        if b > 1:  # at width 1 nothing is drafted or accepted: no zero writes (each is an mmap write under a lock)
            self.draft_tokens.inc(n * (b - 1))
        if tree_budget is not None:
            self.tree_steps[int(tree_budget)].inc()
            self.tree_extra[int(tree_budget)].inc(int(tree_extra))
        if total:
            self.accepted.inc(total)
        top = min(b, self.max_block)  # a tree's path is at most B - 1 deep: its depths are the positions
        if top > 1:
            # at_least[j] = requests with accepted >= j: accepted at position j, and tried at position j + 1
            at_least = np.cumsum(np.bincount(accepted, minlength=top)[::-1])[::-1]
            for j in range(1, top):
                self.tried_by_pos[j - 1].inc(int(at_least[j - 1]))
                if at_least[j]:
                    self.accepted_by_pos[j - 1].inc(int(at_least[j]))
        self.block_steps[b].inc()
        if switched:
            self.switches.inc()
        if b != self._last_block:
            self.block_size.set(b)
            self._last_block = b
        self.goodput.set(predicted_goodput)
        observe_counts(self.committed, np.bincount(accepted + 1, minlength=self.max_block + 1))

    def record_model(self, acceptance: np.ndarray, batch_buckets: Sequence[int], block_sizes: Sequence[int],
                     table: np.ndarray, tree_gain: np.ndarray | None = None) -> None:
        """The controller's model: global p_j, the active cost table and the trees' learned gain (after every
        cost-table sync)."""
        for g, v in zip(self.p, acceptance):
            g.set(float(v))
        for g, v in zip(self.tree_gain, () if tree_gain is None else tree_gain):
            g.set(float(v))
        for i, bb in enumerate(batch_buckets):
            for k, b in enumerate(block_sizes):
                v = float(table[i, k])
                if np.isfinite(v):
                    self._cost.labels(batch_bucket=str(bb), block_size=str(b), **self._labels).set(v)


def observe_counts(histogram, counts: np.ndarray) -> None:
    """``histogram.observe(k)`` ``counts[k]`` times for every k, in one write per non-empty bucket.

    Why: prometheus_client has no weighted observe, and one observe per request (two mmap writes under a lock in
    multiprocess mode) cost ~2.5 us each: ~160 us of a 64-request width-1 step's feedback. This writes the child's
    sum and bucket values the way ``Histogram.observe`` does (prometheus_client 0.26: ``_sum``, ``_buckets``
    non-cumulative, ``_upper_bounds``); tests/unit/test_controller_loop.py pins the exposition to repeated
    observes, and a client without those attributes gets the repeated observes.
    """
    ks = np.flatnonzero(counts)
    if not ks.size:
        return
    try:
        bounds, buckets, total = histogram._upper_bounds, histogram._buckets, histogram._sum
        check = histogram._raise_if_not_observable
    except AttributeError:
        for k in ks:
            for _ in range(int(counts[k])):
                histogram.observe(float(k))
        return
    check()
    total.inc(float(np.dot(ks, counts[ks])))
    for k in ks:
        buckets[bisect.bisect_left(bounds, float(k))].inc(int(counts[k]))
