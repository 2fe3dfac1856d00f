"""Prometheus metrics of the DFLASH_ADAPTIVE worker (names are a contract: docs/ARCHITECTURE.md §4).

Where they live: in the scheduler process, created lazily by the worker on TP rank 0 when SGLang runs with
``--enable-metrics``. By then SGLang has set ``PROMETHEUS_MULTIPROC_DIR`` for its process tree, so
prometheus_client writes them to the shared mmap directory and the HTTP server's MultiProcessCollector serves
them at ``/metrics`` next to SGLang's own. Importing prometheus_client any earlier (e.g. when the plugin is
registered in the main process, before the variable is set) would fix its value class to in-process values and
drop SGLang's own metrics; that is why nothing here runs at import time of the plugin.

Every series carries ``model_name``. Gauges use ``multiprocess_mode="mostrecent"`` (one writer: rank 0).

Counters and histograms (all per TP-rank-0 scheduler; ``rate()`` them) reach /metrics at most FLUSH_STEPS decode
steps late (plain steps counted as a run: RUN_STEPS more, controller_loop.py), and before a finished request's answer:
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
  dflash_ragged_steps_total               decode steps that verified a width per request (per_request_widths; not
                                          in dflash_block_size_steps_total). Share of the steps:
                                          rate(dflash_ragged_steps_total[5m]) / (rate(dflash_ragged_steps_total[5m])
                                            + sum without (block_size) (rate(dflash_block_size_steps_total[5m])))
  dflash_plain_decode_steps_total         width-1 steps run as plain decoding (the target's decode forward and
                                          SGLang's sampler; the rest verify at width 1: GPU, hybrid targets, batches
                                          with penalties, grammars, logprobs). Share of width-1 steps:
                                          rate(dflash_plain_decode_steps_total[5m])
                                            / rate(dflash_block_size_steps_total{block_size="1"}[5m])
  dflash_ragged_request_steps_total{block_size}
                                          request-steps verified at width b inside ragged steps. Mix of widths:
                                          sum by (block_size) (rate(dflash_ragged_request_steps_total[5m]))
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
  dflash_live_request_states              requests the controller keeps per-request state for, written when a
                                          request leaves (finished, aborted, or aborted by the scheduler itself):
                                          0 once idle, else controller state leaked.
  dflash_predicted_goodput_tokens_per_second
                                          the controller's predicted committed tokens/s of the batch at its choice.
                                          Realised: rate(sglang:generation_tokens_total[1m]); ratio = model error.
  dflash_acceptance_probability{position} the controller's global p_j (hindsight-corrected, not censored by b).
  dflash_step_cost_seconds{batch_bucket,block_size}
                                          the active step-cost table T(B, b) the controller decides with.
  dflash_tree_expected_extra_tokens{budget,sampling}
                                          the controller's learned tokens per request-step a tree of `budget`
                                          prefixes commits past chain B's, for greedy and for sampled requests
                                          (negative: the tree's budget misses the chain's deep end); a tree is
                                          chosen when chain B's tokens plus this, over its step cost, beat every
                                          other width.
  dflash_width_calibration{block_size,sampling}
                                          what a width's own steps accepted over what the acceptance curve predicted
                                          for them (controller/calibration.py; sampling = greedy | sampled): the
                                          controller scales the width's expected draft tokens by it. Far from 1:
                                          a drafter whose proposals depend on how many positions it drafts.
                                          avg by (block_size, sampling) (dflash_width_calibration)
  dflash_drafter_info{drafter_version}    1 for the drafter now serving, 0 for those it replaced: "initial" (the
                                          config's drafter) until a hot swap loads a `dflash-serve learn` version.
                                          Which version each replica serves: dflash_drafter_info == 1
Counters (drafter):
  dflash_drafter_swaps_total              hot swaps of the drafter's weights (promotions and rollbacks).
                                          Swaps in the last hour: increase(dflash_drafter_swaps_total[1h])
Histograms:
  dflash_step_seconds{block_size}         wall time of one decode step, start to start of consecutive decode steps
                                          (draft + verify + draft-KV append + SGLang's result processing);
                                          block_size="ragged": the steps that verified a width per request.
                                          p50: histogram_quantile(0.5, sum by (le, block_size) (rate(dflash_step_seconds_bucket[5m])))
  dflash_committed_tokens_per_step        tokens committed per request-step (accepted + 1).
                                          mean: rate(dflash_committed_tokens_per_step_sum[1m]) / rate(dflash_committed_tokens_per_step_count[1m])
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

# Decode steps are counted in process and written at most this many steps late (and when a request finishes:
# SGLang reports a finished request after its last step's feedback, so a client that got its answer sees every step
# of it on /metrics). Why: each counter or bucket write is a multiprocess-mmap write under a lock, slow once the
# forward has evicted the caches, and a step writes dozens of them: a cost every step paid (docs/BENCHMARKS.md).
# The width gauge is still set at once.
FLUSH_STEPS = 16
INITIAL_DRAFTER = "initial"  # dflash_drafter_info's version label before any hot swap
RAGGED = "ragged"  # dflash_step_seconds' block_size label of ragged steps
SAMPLING_CLASSES = ("greedy", "sampled")  # dflash_width_calibration's sampling label, the controller's PRIOR_CLASSES
_STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.0, 2.0, 4.0, 8.0)


class _Counted:
    """What the decode steps counted since the last write add to each series (DFlashMetrics.flush)."""

    def __init__(self, max_block: int) -> None:
        self.steps = 0  # decode steps counted
        self.verify = self.draft = self.accepted = self.switches = 0
        self.tried_at = np.zeros(max_block - 1, dtype=np.int64)  # by position - 1
        self.accepted_at = np.zeros(max_block - 1, dtype=np.int64)
        self.committed = np.zeros(max_block + 1, dtype=np.int64)  # request-steps by tokens committed
        self.by_width: Counter[int] = Counter()
        self.probes: Counter[int] = Counter()
        self.tree_steps: Counter[int] = Counter()  # by budget
        self.tree_extra: Counter[int] = Counter()
        self.ragged = 0
        self.plain = 0  # width-1 steps run as plain decoding
        self.ragged_widths: Counter[int] = Counter()
        self.step_times: dict[int | str, list[float]] = {}
        self.goodput: float | None = None


class DFlashMetrics:
    """The worker's metric families, children pre-resolved so a step costs a few dict-free increments."""

    def __init__(self, model_name: str, max_block: int, candidates: Sequence[int], registry=None,
                 calibrated: Sequence[int] = ()) -> None:
        """``candidates``: the verify widths in use (above ``max_block``: trees of width - 1 prefixes);
        ``calibrated``: the widths the controller calibrates (its ``calibration[0].widths``)."""
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
        self.ragged_steps = counter("dflash_ragged_steps", "Decode steps that verified a width per request").labels(
            **labels)
        self.plain_steps = counter("dflash_plain_decode_steps",
                                   "Width-1 decode steps run as plain decoding (target decode forward, SGLang's "
                                   "sampler)").labels(**labels)
        ragged = counter("dflash_ragged_request_steps", "Request-steps verified at width b in ragged steps",
                         ["block_size"])
        self.ragged_request_steps = {b: ragged.labels(block_size=str(b), **labels) for b in candidates
                                     if b <= self.max_block}
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
                     "Controller's learned tokens per request-step a tree commits past chain B's",
                     ["budget", "sampling"])
        self.tree_gain = [[gain.labels(budget=str(n), sampling=s, **labels) for n in budgets]
                          for s in SAMPLING_CLASSES]
        calibration = gauge("dflash_width_calibration",
                            "Accepted drafts a width's own steps got over the acceptance curve's prediction",
                            ["block_size", "sampling"])
        self.calibration = [[calibration.labels(block_size=str(b), sampling=s, **labels)
                             for b in calibrated] for s in SAMPLING_CLASSES]
        self.block_size = gauge("dflash_block_size", "Verify width of the latest decode step").labels(**labels)
        self.live_request_states = gauge("dflash_live_request_states",
                                         "Requests holding per-request controller state").labels(**labels)
        self.goodput = gauge("dflash_predicted_goodput_tokens_per_second",
                             "Predicted committed tokens/s of the batch at the chosen width").labels(**labels)
        p = gauge("dflash_acceptance_probability", "Controller's global conditional acceptance p_j", ["position"])
        self.p = [p.labels(position=pos, **labels) for pos in positions]
        self._cost = gauge("dflash_step_cost_seconds", "Active step-cost table T(B, b)", ["batch_bucket", "block_size"])
        self._labels = labels
        step_seconds = Histogram("dflash_step_seconds", "Decode step wall time", names + ["block_size"],
                                 buckets=_STEP_BUCKETS, registry=registry)
        self.step_seconds: dict[int | str, Any] = {b: step_seconds.labels(block_size=str(b), **labels)
                                                   for b in candidates}
        self.step_seconds[RAGGED] = step_seconds.labels(block_size=RAGGED, **labels)
        self.committed = Histogram("dflash_committed_tokens_per_step", "Tokens committed per request-step", names,
                                   buckets=tuple(float(k) for k in range(1, self.max_block + 1)),
                                   registry=registry).labels(**labels)
        self._last_block: int | None = None
        self._counted = _Counted(self.max_block)
        self._drafter = gauge("dflash_drafter_info", "1 for the drafter version serving, 0 for those it replaced",
                              ["drafter_version"])
        self.drafter_swaps = counter("dflash_drafter_swaps", "Hot swaps of the drafter's weights").labels(**labels)
        self.drafter_version = INITIAL_DRAFTER
        self._drafter.labels(drafter_version=INITIAL_DRAFTER, **labels).set(1)

    def record_drafter(self, version: str | None) -> None:
        """A draft weight update finished; ``version`` names the drafter it completed (None: a partial update, one
        chunk of several: not a swap yet)."""
        if version is None or version == self.drafter_version:
            return
        self._drafter.labels(drafter_version=self.drafter_version, **self._labels).set(0)
        self._drafter.labels(drafter_version=version, **self._labels).set(1)
        self.drafter_version = version
        self.drafter_swaps.inc()

    def flush(self) -> None:
        """Write what the steps counted since the last write add (FLUSH_STEPS)."""
        c = self._counted
        if not (c.steps or c.step_times):
            return
        self._counted = _Counted(self.max_block)
        # zero increments are not written (each write is an mmap write under a lock); every series exists from
        # start-up, so an unwritten one reads 0
        for counter, n in ((self.verify_steps, c.verify), (self.draft_tokens, c.draft), (self.accepted, c.accepted),
                           (self.switches, c.switches), (self.ragged_steps, c.ragged),
                           (self.plain_steps, c.plain)):
            if n:
                counter.inc(n)
        for j in np.flatnonzero(c.tried_at):
            self.tried_by_pos[j].inc(int(c.tried_at[j]))
        for j in np.flatnonzero(c.accepted_at):
            self.accepted_by_pos[j].inc(int(c.accepted_at[j]))
        for counters, counts in ((self.block_steps, c.by_width), (self.probes, c.probes),
                                 (self.tree_steps, c.tree_steps), (self.tree_extra, c.tree_extra),
                                 (self.ragged_request_steps, c.ragged_widths)):
            for key, n in counts.items():
                if n:
                    counters[key].inc(n)
        for b, seconds in c.step_times.items():
            observe_values(self.step_seconds[b], np.asarray(seconds))
        if c.goodput is not None:
            self.goodput.set(c.goodput)
        observe_counts(self.committed, c.committed)

    def record_step(self, *, block_size: int, switched: bool, accepted: np.ndarray, predicted_goodput: float,
                    probe: bool = False, tree_budget: int | None = None, tree_extra: int = 0,
                    widths: Sequence[int] | None = None, plain: bool = False, steps: int = 1) -> None:
        """One verified decode step, or ``steps`` alike of width 1 (a plain run, controller_loop.py). ``accepted``:
        draft tokens accepted per request (int array); ``probe``: the step drafted the full block only to observe
        acceptance (``Decision.probe``); ``tree_budget``: the step verified a tree of that many nodes (width
        ``block_size`` = budget + 1), committing ``tree_extra`` tokens past the greedy chain's; ``widths``: a ragged
        step's width per request (``block_size`` the widest); ``plain``: a width-1 step run as plain decoding.
        Counted in process, written every FLUSH_STEPS steps (``flush``)."""
        b, c = int(block_size), self._counted
        if steps != 1 and (b != 1 or widths is not None):
            raise ValueError(f"steps: only width-1 steps are counted together, got {steps} at width {b}")
        n = int(accepted.shape[0])
        c.verify += n * steps
        if widths is not None:
            w = np.asarray(widths, dtype=np.int64)
            c.ragged += 1
            c.ragged_widths.update(w.tolist())
            c.draft += int((w - 1).sum())
            c.accepted += int(accepted.sum())
            j = np.arange(1, b)  # positions 1 .. b - 1
            tried = (w[:, None] - 1 >= j) & (accepted[:, None] >= j - 1)
            c.tried_at[: b - 1] += tried.sum(axis=0)
            c.accepted_at[: b - 1] += (accepted[:, None] >= j).sum(axis=0)
            c.committed[1: b + 1] += np.bincount(accepted, minlength=b)[:b]
        elif b > 1:
            c.by_width[b] += 1
            c.draft += n * (b - 1)
            c.accepted += int(accepted.sum())
            top = min(b, self.max_block)  # a tree's path is at most B - 1 deep: its depths are the positions
            counts = np.bincount(accepted, minlength=top)
            # at_least[j] = requests with accepted >= j: accepted at position j, and tried at position j + 1
            at_least = np.cumsum(counts[::-1])[::-1]
            c.tried_at[: top - 1] += at_least[: top - 1]
            c.accepted_at[: top - 1] += at_least[1:top]
            c.committed[1: top + 1] += counts[:top]
        else:
            c.by_width[b] += steps
            c.committed[1] += n * steps  # a width-1 step commits one token per request
            c.plain += plain * steps
        if probe:
            c.probes[b] += steps
        if tree_budget is not None:
            c.tree_steps[int(tree_budget)] += 1
            c.tree_extra[int(tree_budget)] += int(tree_extra)
        if switched:
            c.switches += 1
        if b != self._last_block:
            self.block_size.set(b)
            self._last_block = b
        c.goodput = predicted_goodput
        c.steps += steps
        if c.steps >= FLUSH_STEPS:
            self.flush()

    def record_step_time(self, block_size: int, seconds: float) -> None:
        """One decode step's wall time (``dflash_step_seconds``), written with the steps' counts."""
        self._counted.step_times.setdefault(int(block_size), []).append(float(seconds))

    def record_ragged_step_time(self, seconds: float) -> None:
        """A ragged step's wall time (``dflash_step_seconds{block_size="ragged"}``)."""
        self._counted.step_times.setdefault(RAGGED, []).append(float(seconds))

    def record_model(self, acceptance: np.ndarray, batch_buckets: Sequence[int], block_sizes: Sequence[int],
                     table: np.ndarray, tree_gain: np.ndarray | None = None,
                     calibration: np.ndarray | None = None) -> None:
        """The controller's model: global p_j, the active cost table, the trees' learned gain [sampling classes,
        trees] and the widths' calibration [sampling classes, widths 2..B] (after every cost-table sync)."""
        for g, v in zip(self.p, acceptance):
            g.set(float(v))
        for gauges, row in zip(self.tree_gain, () if tree_gain is None else tree_gain):
            for g, v in zip(gauges, row):
                g.set(float(v))
        for gauges, row in zip(self.calibration, () if calibration is None else calibration):
            for g, v in zip(gauges, row):
                g.set(float(v))
        for i, bb in enumerate(batch_buckets):
            for k, b in enumerate(block_sizes):
                v = float(table[i, k])
                if np.isfinite(v):
                    self._cost.labels(batch_bucket=str(bb), block_size=str(b), **self._labels).set(v)


def observe_counts(histogram, counts: np.ndarray) -> None:
    """``histogram.observe(k)`` ``counts[k]`` times for every k, in one write per non-empty bucket.

    Why: prometheus_client has no weighted observe, and one observe per request (two mmap writes under a lock in
    multiprocess mode) made a large batch's feedback cost grow with its size. This writes the child's
    sum and bucket values the way ``Histogram.observe`` does (prometheus_client 0.26: ``_sum``, ``_buckets``
    non-cumulative, ``_upper_bounds``); tests/unit/test_controller_loop.py pins the exposition to repeated
    observes, and a client without those attributes gets the repeated observes.
    """
    ks = np.flatnonzero(counts)
    if ks.size:
        _observe_many(histogram, ks.astype(np.float64), counts[ks])


def observe_values(histogram, values: np.ndarray) -> None:
    """``histogram.observe(v)`` for every v of ``values``, in one write per non-empty bucket (observe_counts)."""
    if values.size:
        _observe_many(histogram, values.astype(np.float64), np.ones(values.size, dtype=np.int64))


def _observe_many(histogram, values: np.ndarray, weights: np.ndarray) -> None:
    try:
        bounds, buckets, total = histogram._upper_bounds, histogram._buckets, histogram._sum
        check = histogram._raise_if_not_observable
    except AttributeError:
        for v, w in zip(values, weights):
            for _ in range(int(w)):
                histogram.observe(float(v))
        return
    check()
    total.inc(float(np.dot(values, weights)))
    # Histogram.observe's bucket: bisect_left(upper bounds, value)
    per_bucket = np.bincount(np.searchsorted(np.asarray(bounds), values, side="left"), weights=weights,
                             minlength=len(bounds))
    for i in np.flatnonzero(per_bucket):
        buckets[int(i)].inc(int(per_bucket[i]))
