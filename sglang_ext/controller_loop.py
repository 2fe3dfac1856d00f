"""The DFLASH_ADAPTIVE feedback loop: decisions out, host-side results in. No tensors, no SGLang.

Why apart from the worker: the worker (worker.py) is the tensor path -- draft, verify, accept, draft-KV append --
and changes when SGLang's DFlash code changes; this loop is the bookkeeping around it -- which step is pending,
what a step cost, what the controller and Prometheus are told -- and changes when the controller does. Here it
runs and is tested without SGLang or torch (tests/unit/test_controller_loop.py).

Contract (the worker calls, in this order per decode step):
  * ``begin_decode(rids, now, trees, sampled, ragged)`` -> ``Decision``: credits the start-to-start interval that
    just ended to the decode step it measures (see "Step times") and asks the controller for this step's width
    (``trees`` False: the batch cannot verify a tree; ``sampled``: which requests sample, None if all are greedy;
    ``ragged``: the worker can verify a width per request, ``Decision.widths``);
  * ``launched(step)``: the step ``begin_decode`` last decided is on its way; its host copies (``drafted``,
    ``committed``) are read only in ``complete``, after SGLang's copy-done sync;
  * ``complete(accepted, batch_size)``: SGLang's ``on_verify_complete_cpu``, in launch order; feeds acceptance,
    hindsight, the cost-table broadcast and metrics. Never raises: a fault is logged and counted
    (``dflash_controller_errors_total``) and serving keeps the last width;
  * ``interrupt()``: a non-decode forward (prefill, idle) is being launched: no interval it touches is a decode
    step's time; ``request_finished(rid)``: forget a request (also when its last step is still pending), for every
    way a request leaves: finished, aborted, or aborted by the scheduler (inside ``retract_decode``, or while
    queued). A retracted request that is re-queued is not finished: its state is kept under its rid and its next
    steps continue it (lossless either way: the state only picks widths, and the request's acceptance history
    still describes it after re-prefill).
Step times: the interval between two consecutive launches [t_k, t_k+1] is credited to one decode step, never to a
prefill. Without the overlap scheduler the host processes step k before it launches k + 1, so the interval is step
k's (k and k + 1 decode steps). With the overlap scheduler (the GPU default) step k + 1 is launched after the host
processed step k - 1 (waiting for it on the device) while step k runs: the interval is step k - 1's, and it is
credited to k - 1 only when k - 1, k and k + 1 are all decode steps (a prefill in flight would be in it).
Plain runs: a plain step (``LaunchedStep.plain``) of the batch and classes the controller last observed, and the
steps of the same batch that follow it while the controller holds its decision (policy.py, held plain decisions),
observe nothing but a step elapsing; they are counted and folded into the controller, the cost learner, the
cost-table sync and metrics together -- before the next decision the controller does not hold, before a request
leaves or the drafter changes, at the step whose feedback syncs the cost table, and at least every RUN_STEPS
steps. The controller reads nothing they change while it holds, so its decisions and state are the ones per-step
feedback gives (tests/unit/test_controller_loop.py). Why: feedback per plain step cost a noticeable part of a plain
step, where plain decoding has none (docs/BENCHMARKS.md).
Invariants: decisions depend only on data identical on every TP rank (rids, accept counts, the broadcast cost
table); step times, cost learning and metrics are rank 0's; nothing here waits on a device.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from sglang_ext.controller.cost_model import CostModel
from sglang_ext.controller.policy import BlockSizeController, Decision
from sglang_ext.settings import AdaptiveSettings

logger = logging.getLogger(__name__)
RECENT_FINISHED = 4096  # finished rids remembered for steps still in flight when their request ended
MODEL_PUBLISH_SECONDS = 1.0  # the acceptance/cost gauges at most this often: each publish costs a step real time,
# and Prometheus scrapes far less often
RUN_STEPS = 16  # a plain run is folded at least this often (metrics stay within two metric flushes of the steps)


class HostArray(Protocol):
    """A host copy that may still be in flight (a CPU torch tensor filled by a non-blocking copy)."""

    def numpy(self) -> np.ndarray: ...


class Metrics(Protocol):
    """What the loop publishes (sglang_ext.metrics.DFlashMetrics)."""

    errors: Any
    live_request_states: Any  # a gauge: .set(n)

    def record_step(self, *, block_size: int, switched: bool, accepted: np.ndarray, predicted_goodput: float,
                    probe: bool = False, tree_budget: int | None = None, tree_extra: int = 0,
                    widths: Sequence[int] | None = None, plain: bool = False, steps: int = 1) -> None: ...

    def record_step_time(self, block_size: int, seconds: float) -> None: ...

    def record_ragged_step_time(self, seconds: float) -> None: ...

    def flush(self) -> None: ...

    def record_drafter(self, version: str | None) -> None: ...

    def record_model(self, acceptance: np.ndarray, batch_buckets: Sequence[int], block_sizes: Sequence[int],
                     table: np.ndarray, tree_gain: np.ndarray | None = None,
                     calibration: np.ndarray | None = None) -> None: ...


@dataclass(frozen=True)
class StepStart:
    """When a decode step was launched, for how many requests, at which width."""

    start: float
    batch_size: int
    decision: Decision


@dataclass(frozen=True)
class LaunchedStep:
    """A decode step whose results are on their way to the host."""

    rids: list[str]
    decision: Decision
    drafted: HostArray | None  # [bs, B - 1] drafted block; None unless the step drafted the full block
    committed: HostArray  # [bs, b]: accepted drafts then the bonus token, per request (a tree step: [bs, B])
    tree_path: HostArray | None = None  # a tree step (width > B): [bs, B - 1] walked node indices, -1 past the end
    # (drafted: the tree's greedy chain)
    plain: bool = False  # a width-1 step run as plain decoding (steps/plain.py)


@dataclass
class _PlainRun:
    """Plain steps of one batch counted since the step that opened the run (module docstring: plain runs)."""

    rids: list[str]
    sampled: Sequence[bool] | None
    decision: Decision  # the opening step's (the steps that join it were held to it: none switched)
    limit: int  # steps it may count: RUN_STEPS, or fewer where per-step feedback would sync the cost table
    steps: int = 0  # steps counted, observed at the fold
    times: list[tuple[float, StepStart]] = field(default_factory=list)  # their step times, credited at the fold


class ControllerLoop:
    def __init__(self, settings: AdaptiveSettings, max_block: int, *, is_rank0: bool,
                 broadcast: Callable[[Any], Any] | None = None, metrics: Metrics | None = None,
                 overlap: bool = False, prefix_drafts: bool = False) -> None:
        """``broadcast``: the TP group's object broadcast from rank 0 (None on a single rank); ``overlap``: SGLang's
        overlap scheduler is on (the next step launches before this one's result is processed); ``prefix_drafts``:
        the worker drafts only the verified positions below the full block (BlockSizeController)."""
        cfg = settings.controller_in_use()
        cfg.check_against_max_block(max_block)  # the same rule the preflight applied: a hand-run server too
        candidates = list(cfg.candidates_for(max_block))
        cost = (CostModel.from_profile(settings.cost_profile, candidates, ema=cfg.cost_ema)
                if settings.cost_profile else CostModel.default(candidates, ema=cfg.cost_ema))
        self.settings = settings
        self.controller = BlockSizeController(cfg, cost, max_block=max_block, is_rank0=is_rank0,
                                              prefix_drafts=prefix_drafts)
        self.is_rank0 = is_rank0
        self.metrics = metrics
        self._broadcast = broadcast
        # the latest launches, oldest first (None: a non-decode forward); an interval ending now is the oldest's
        self._launches: deque[StepStart | None] = deque(maxlen=2 if overlap else 1)
        # launched steps awaiting their results, each with its batch's ``sampled`` (given to begin_decode)
        self._pending: deque[tuple[LaunchedStep, Sequence[bool] | None]] = deque()
        self._sampled: Sequence[bool] | None = None  # the last begin_decode's
        self._finished: deque[str] = deque(maxlen=RECENT_FINISHED)
        self._finished_set: set[str] = set()
        self._run: _PlainRun | None = None
        self._published = float("-inf")
        if metrics is not None:
            self._publish_model()

    @property
    def candidates(self) -> tuple[int, ...]:
        return self.controller.candidates

    # -- launch side -------------------------------------------------------------------------------------------
    def begin_decode(self, rids: list[str], now: float, trees: bool = True,
                     sampled: Sequence[bool] | None = None, ragged: bool = False) -> Decision:
        window, run, ctl = self._launches, self._run, self.controller
        if len(window) == window.maxlen and all(s is not None for s in window):
            start = window[0]
            if run is not None and start.batch_size == len(run.rids) and _plain_width(start.decision):
                run.times.append((now - window[-1].start, start))
            else:
                self._record_step_time(now - window[-1].start, start)
        decision = None if run is None else ctl.held(rids, trees, sampled, ragged)
        if decision is None:
            self._fold()  # the controller asks its parts: they see every step before it
            decision = ctl.decide(rids, trees, sampled, ragged)
        self._sampled = sampled
        window.append(StepStart(now, len(rids), decision))
        return decision

    def interrupt(self) -> None:
        self._launches.append(None)

    def launched(self, step: LaunchedStep) -> None:
        self._pending.append((step, self._sampled))

    def _record_step_time(self, seconds: float, step: StepStart) -> None:
        """The full step time T(B, b): from one decode step's start to the next's (draft, verify, draft-KV append,
        and the scheduler's result processing and scheduling in between, which grow with the committed tokens).
        Host clock only: the host reaches a launch after its copy-done sync of the step the interval is credited to
        (the previous one, or the one before it under the overlap scheduler), so in steady state the interval is
        that step's device time plus the host's work, with no sync of our own."""
        if not self.is_rank0:
            return
        try:
            d = step.decision
            if d.widths is not None:  # a ragged step is no width's cost: it teaches ragged steps' own price
                if self.settings.learn_costs:
                    self.controller.observe_ragged_time(step.batch_size, d.widths, seconds)
                if self.metrics is not None:
                    self.metrics.record_ragged_step_time(seconds)
                return
            if self.settings.learn_costs:
                self.controller.observe_step_time(step.batch_size, d.block_size, seconds, probe=d.probe)
            if self.metrics is not None:
                self.metrics.record_step_time(d.block_size, seconds)
        except Exception:
            logger.exception("dflash-serve: step-time feedback failed (serving continues)")

    # -- result side (after SGLang's copy-done sync) -------------------------------------------------------------
    def complete(self, accepted: Sequence[int], batch_size: int) -> None:
        popped = self._pop(batch_size)
        if popped is None:
            return
        try:
            step, sampled = popped
            run, ctl = self._run, self.controller
            if not (run is not None and step.plain and step.rids == run.rids and sampled == run.sampled):
                self._fold()
                run = None
                if step.plain and ctl.plain_applies(step.rids, sampled):
                    # a run opens: it and what follows alike, up to the step whose feedback would sync the cost
                    # table, are observed together
                    run = self._run = _PlainRun(step.rids, sampled, step.decision,
                                                min(RUN_STEPS, ctl.steps_to_sync))
            if run is not None:
                run.steps += 1
                if run.steps >= run.limit:
                    self._fold()
                return
            self._observe(step, sampled, np.asarray(accepted, dtype=np.int64))
        except Exception:  # a controller fault must not take serving down: keep the last width, say so
            logger.exception("dflash-serve: controller feedback failed (serving continues)")
            if self.metrics is not None:
                self.metrics.errors.inc()

    def _pop(self, batch_size: int) -> tuple[LaunchedStep, Sequence[bool] | None] | None:
        # Results arrive in launch order; a step whose result SGLang never processed is dropped here.
        while self._pending:
            step, sampled = self._pending.popleft()
            if len(step.rids) == batch_size:
                return step, sampled
            logger.warning("dflash-serve: dropping feedback of a %d-request step (got %d)", len(step.rids),
                           batch_size)
        return None

    def _observe(self, step: LaunchedStep, sampled: Sequence[bool] | None, accepted: np.ndarray) -> None:
        d, ctl = step.decision, self.controller
        committed = step.committed.numpy()  # [bs, b]: a row is what it committed up to accepted + 1
        rows = committed if committed.shape[1] == 1 else [row[: a + 1] for row, a in zip(committed, accepted)]
        ctl.observe_step(step.rids, d.block_size, accepted,
                         None if step.drafted is None else step.drafted.numpy(), rows, sampled, d.widths)
        extra, budget = 0, None
        if step.tree_path is not None:
            ctl.observe_tree(d.block_size, step.rids, step.tree_path.numpy())
            # for the metric: the tokens past the point where the path left the greedy draft
            drafted = step.drafted.numpy()
            w = min(drafted.shape[1], committed.shape[1])
            chain = np.minimum((drafted[:, :w] == committed[:, :w]).cumprod(axis=1).sum(axis=1), accepted)
            extra, budget = int((accepted - chain).sum()), d.block_size - 1
        self._after_observe(step.rids, d, accepted, extra=extra, budget=budget, plain=step.plain)

    def _fold(self) -> None:
        """Observe the open plain run's steps, credit their step times, and close it (module docstring)."""
        run, self._run = self._run, None
        if run is None:
            return
        try:
            for seconds, start in run.times:
                self._record_step_time(seconds, start)
            if run.steps:
                if not self.controller.observe_plain(run.rids, run.sampled, run.steps):
                    raise RuntimeError("a plain run's batch changed before it was observed")
                self._after_observe(run.rids, run.decision, np.zeros(len(run.rids), dtype=np.int64), plain=True,
                                    steps=run.steps)  # the opening step's switch, if it switched, counted once
        except Exception:
            logger.exception("dflash-serve: controller feedback failed (serving continues)")
            if self.metrics is not None:
                self.metrics.errors.inc()

    def _after_observe(self, rids: list[str], d: Decision, accepted: np.ndarray, *, extra: int = 0,
                       budget: int | None = None, plain: bool = False, steps: int = 1) -> None:
        """What follows the observation of ``steps`` steps of one kind: requests that finished while they were in
        flight, the cost-table sync, metrics."""
        ctl = self.controller
        if not self._finished_set.isdisjoint(rids):  # a request finished while this step was in flight
            for rid in rids:
                if rid in self._finished_set:
                    ctl.finish(rid)
            if self.metrics is not None:
                self.metrics.live_request_states.set(ctl.live_requests)
        synced = False
        if ctl.cost_sync_due:
            ctl.sync_cost_table(self._broadcast)
            synced = True
        if self.metrics is not None:
            self.metrics.record_step(block_size=d.block_size, switched=d.switched, accepted=accepted,
                                     predicted_goodput=d.predicted_goodput, probe=d.probe,
                                     tree_budget=budget, tree_extra=extra, widths=d.widths, plain=plain,
                                     steps=steps)
            if synced and time.monotonic() - self._published >= MODEL_PUBLISH_SECONDS:
                self._publish_model()

    def _publish_model(self) -> None:
        self._published = time.monotonic()
        cost = self.controller.cost_model
        self.metrics.record_model(self.controller.acceptance_probabilities(), cost.batch_buckets,
                                  cost.block_sizes, cost.table, self.controller.tree_gains(),
                                  self.controller.calibration_ratios())

    def drafter_swapped(self, version: str | None) -> None:
        """The drafter's weights were replaced: the controller's acceptance priors are reset, the swap counted."""
        self._fold()
        self.controller.drafter_changed()
        if self.metrics is not None:
            self.metrics.record_drafter(version)
            self._publish_model()

    def request_finished(self, rid: str) -> None:
        self._fold()
        if self.metrics is not None:
            self.metrics.flush()  # the steps counted in process are on /metrics before the request's answer
        self.controller.finish(rid)
        if self.metrics is not None:
            self.metrics.live_request_states.set(self.controller.live_requests)
        if len(self._finished) == self._finished.maxlen:
            self._finished_set.discard(self._finished[0])
        self._finished.append(rid)
        self._finished_set.add(rid)


def _plain_width(d: Decision) -> bool:
    """A decision whose step may be a plain step: width 1, nothing drafted, one width for the batch."""
    return d.block_size == 1 and not d.draft_full and d.widths is None
