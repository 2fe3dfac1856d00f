"""The block-size controller: picks the verify width b for every decode step.

Why: the best b shrinks as load grows (verify turns compute-bound) and depends on what the requests are; a fixed b
is wrong somewhere. ``fixed`` and ``schedule`` modes exist for operators who want control.

Adaptive decision. Score every candidate b, pick the best, but switch away from the current block c only if the
best beats it by more than ``hysteresis`` and c has been used for ``min_dwell_steps`` decisions (waived when the
batch-size bucket changes), so noise does not make it flap.
  * objective ``step``: G(b) = sum_r E_r(b) / T(B, b), this step's predicted goodput (docs/ARCHITECTURE.md §3).
  * objective ``steady`` (default): G(b) = B * H(b) / T(B, b), H(b) = sum_r w_r / sum_r (w_r / E_r(b)) with
    w_r = E_r(c). Why: in a busy server a finished request is replaced, and a request that accepts little stays
    in the batch longer, so the batch is over-weighted (per token) with low-acceptance requests. The long-run
    goodput of running b is the token-weighted HARMONIC mean of E_r(b), not this step's sum; the step objective
    over-values wide blocks whenever acceptance differs across requests (in the simulator: 0.95 vs 0.975 of the
    best fixed b on per-request switching traffic at C=32). Both objectives are equal at b = c, so the
    hysteresis compares like with like; with one request they are identical.
  * exploration: a block whose cost cell (this batch bucket) has fewer than max(4, min_dwell_steps)
    measurements, or is stale, and whose predicted goodput is within ``explore_margin`` of c's, is tried for one
    dwell period (each cell at most once per 4 sync intervals). If the seed table was modelled rather than
    profiled on this machine (``CostModel.seed_measured`` False: roofline default, a guess), every never-measured
    cell of the bucket in use predicted at least NEVER_FLOOR (0.5) of c's goodput is tried once, unless that
    width was measured at a bucket within 2x of this batch size (its cell is then priced from that measurement,
    cost_model.active_measured_near; on CPU, prose at 32 users spread over 4-5 buckets and tried widths 2 and 4
    once in each: 2.5 % of steps at 1.5-2x a width-1 step's cost). Why:
    unmeasured cells are extrapolated; an overstated one would otherwise never be chosen, hence never measured
    (with a flat seed the simulator stayed on b=16 at C=64 at 0.67 of the best fixed b). Why the floor: trying a
    hopeless width costs a dwell period of steps 2-20x dearer at every new load level (NEVER_FLOOR).
  * probes: at b = 1 the worker skips the draft; every ``probe_interval`` steps the decision asks for a full
    draft anyway so hindsight keeps observing acceptance (stretched up to 4x for batches of 16+: PROBE_ROWS).
    While a drafted width is predicted within
    ``probe_near_ratio`` of width 1, every ``probe_near_interval`` steps instead, that interval doubling (up to
    ``probe_interval``) after each such probe, and back to ``probe_near_interval`` when the acceptance evidence
    (the widest width's expected tokens over the current width's) has risen by more than PROBE_SURPRISE (5 %)
    since the last probe, or the width switched (not to try a width, ``_explore``, nor back from one). Why: at b = 1
    probes are the only evidence, and a request's estimate starts at the global one (prior strength 8): at one
    probe per 32 steps the controller measured ~70 % of steps still at b = 1 three code requests after a prose
    phase (tests/integration/test_adaptive.py), though those requests accept ~6 tokens a step. But a probe costs a
    draft forward (~0.45 of a width-1 step on CPU): probing every 4 steps forever, where the drafter guesses a
    little (prose at temperature 1: within 0.7 of width 1, never above it), cost ~7 % of throughput. Doubling
    keeps the fast look while the evidence moves and pays ~1/32 of a draft per step once it has settled.
  * trees: a candidate width w above the drafter's block B verifies a DDTree of w - 1 draft prefixes (worker.py).
    Its expected tokens are chain B's plus the tree's learned gain over chain B (tree_gain.py: every tree step
    measures, for every narrower tree at once, its tokens less the request's expected chain-B tokens -- the
    estimate hindsight keeps exact from the committed stream, so a tree that misses the chain's deep end shows
    the loss), one gain per prior class, as the acceptance priors and the calibration are: what a tree adds past
    greedy code's chain says nothing about what it adds to text sampled at temperature 1 (one gain for both would
    lift a prose request's tree of 31 from chain B's ~1.05 tokens a step to ~2.2 with the gain the CPU sweep's
    code measured, and keep it there: prose trees are rare, the gain's evidence mostly code's); its cost is its
    own column of the table. A batch the worker
    cannot verify as a tree (``decide(..., trees=False)``: grammars, logprobs, penalties) runs chain B instead, as
    its decision says, so the step time is chain B's. Why a gain over chain B rather than a model of the tree:
    the chain's per-request acceptance already tells which requests draft well; what the tree adds is measured.
  * prefix drafts: with ``prefix_drafts`` (the worker drafts only the b positions it verifies when 1 < b < B: CPU,
    no draft CUDA graph) such a width probes too, with a full draft, on the same schedule with "a wider width" for
    "a drafted width": its own steps show acceptance only up to b - 1, the wider widths' evidence comes from the
    probes, and their step times (not width b's) are not learned. Why the near schedule there too: unobserved
    positions take their neighbour's estimate, but a code drafter's conditional acceptance rises with depth; with
    one probe per 32 steps the switching test (tests/integration/test_adaptive.py) started the first code request
    at b = 4 and spent 29 of its 41 steps at b = 1. Without ``prefix_drafts`` b > 1 always drafts the full block.
    With ``prefix_drafts`` the expected tokens of each width 1 < b < B are also calibrated by that width's own
    (non-probe) steps, per prior class (calibration.py): a drafter that attends within its block both ways proposes
    differently when it drafts fewer positions, and the curve learns mostly from full drafts.

  * per-request widths (off by default): when the worker can run a ragged step for this batch (``decide(...,
    ragged=True)``) and ``per_request_widths`` is set, each request may get its own width (``Decision.widths``) if that is
    predicted to beat the batch-wide choice by more than ``hysteresis`` (ragged.py: priced at the mean width from
    measured cells only). The batch-wide state -- current width, dwell, probes -- runs on underneath: a ragged step
    is an overlay on this step, and a probe due this step runs batch-wide instead. Why: requests the drafter
    cannot guess verify as wide as the rest otherwise. Measured side by side it is mixed: 1.03-1.13x one width per
    batch at 16-50 users in two runs, 0.92-0.96x at 4-8 users in two others (README "Per-request widths").

Tensor-parallel determinism (critical). Every TP rank runs its own controller; if two ranks pick different b the
collectives of the verify forward hang. So a decision depends ONLY on inputs that are identical on every rank:
  * acceptance data: accepted counts, drafted and committed tokens (``observe_step``), identical after sampling;
  * the batch (request ids, batch size) and the call sequence (step counters for dwell and probing);
  * the ACTIVE cost table, which changes only through ``CostModel.load`` of a table that rank 0 exported and
    broadcast (``sync_cost_table``), and carries a ``version``.
Measured wall times differ per rank, so they enter ONLY through rank 0's cost-model learner: ``observe_step_time``
raises on other ranks, and even on rank 0 a measurement changes nothing until the next broadcast. Call
``sync_cost_table`` on all ranks at the same step (``cost_sync_due`` is computed from the identical step count).

Worker contract (what AdaptiveDFlashWorker calls, in this order per decode step):
  1. ``d = decide(request_ids, trees, sampled, ragged)``: verify width ``d.block_size`` (above max_block: a tree;
     ``trees`` False: the batch cannot verify a tree, so none is chosen; ``d.widths``: a width per request, the
     widest being ``d.block_size``, only when ``ragged``: the worker can run that this step); draft the full block iff
     ``d.draft_full``; else draft nothing at b = 1 and, with ``prefix_drafts``, only the first b positions at
     b > 1 (``d.probe``: a full draft the width alone would not have run, once every ``probe_interval`` steps
     so hindsight keeps learning).
  2. after the step's results are on the host: ``observe_step(request_ids, b, accepted, drafted, committed,
     sampled, widths)`` (``drafted`` = the full drafted block [bs, max_block - 1], or None unless ``d.draft_full``;
     ``sampled``: which requests sample, as given to decide -- the prior class, PRIOR_CLASSES), and on rank 0
     ``observe_step_time(bs, b, seconds, probe=d.probe)``; after a tree step also ``observe_tree(b, request_ids,
     path)``. With overlap scheduling these arrive one step late; that is fine.
  3. ``finish(request_id)`` for every finished or aborted request (frees its slot).
  4. when ``cost_sync_due``: ``sync_cost_table(broadcast)`` on every rank.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from .acceptance import AcceptanceStats
from .calibration import WidthCalibration
from .config import ControllerConfig
from .cost_model import CostModel
from .hindsight import HindsightBuffer
from .ragged import assign
from .slots import SlotMap
from .tree_gain import TreeGain, tree_commits

# A never-measured cell under a modelled seed is tried whatever it predicts, down to this fraction of the current
# width's goodput. Why a floor: below it the extrapolated cost would have to be over 2x too high to hide a better
# width (cost_model.py prices unmeasured cells on the line of the bucket's measured residuals), while trying it
# costs a dwell period of steps that are 2-20x dearer -- on CPU, prose at 32 users tried width 16 (3x a width-1
# step) and the adaptive shape at 8 users trees of 32/64 (5-17x) at every new load level.
NEVER_FLOOR = 0.5

# The far probe interval grows with the batch: probe_interval x min(PROBE_STRETCH_MAX, batch // PROBE_ROWS) steps.
# Why: one probe observes every request of the batch, so a batch of 32 learns from one probe what one request learns
# from 32, while the probe's full draft costs ~0.7-1.2x a width-1 step at 16-32 requests on CPU (a draft forward
# of 16 positions per request against a one-token decode): on prose at temperature 1, 32 users, probes were 4 % of
# steps and ~4 % of the scheduler's time (py-spy), the largest part of adaptive's gap to plain decoding after the
# width-1 step itself. Near probes (a drafted width within probe_near_ratio) keep their short interval.
PROBE_ROWS = 8
PROBE_STRETCH_MAX = 4

# Prior classes of the acceptance statistics (acceptance.py): 0 greedy requests, 1 sampled ones (``sampled`` in
# decide / observe_step). A new request's estimate starts from its own class's global one.
PRIOR_CLASSES = 2


def calibrated_widths(candidates: Sequence[int], max_block: int, prefix_drafts: bool) -> tuple[int, ...]:
    """The widths a controller calibrates (calibration.py): those drafted as a prefix, whose draft is not the full
    one the acceptance curve mostly learns from."""
    return tuple(int(b) for b in candidates if 2 <= b < max_block) if prefix_drafts else ()


def _classes(sampled: Sequence[bool] | None, n: int) -> np.ndarray | None:
    """Per-request prior class (None: every request greedy)."""
    if sampled is None:
        return None
    cls = np.asarray(sampled, dtype=np.intp)
    if cls.shape != (n,):
        raise ValueError(f"sampled: expected {n} entries, got shape {cls.shape}")
    return cls


@dataclass(frozen=True)
class Decision:
    """What to run this step.

    block_size: verify width b (1 = plain decoding).
    draft_full: run the drafter over its full trained block this step (else over the b verified positions with
        ``prefix_drafts``, or the full block; nothing at b = 1).
    predicted_goodput: predicted committed tokens per second of the whole batch at ``block_size``.
    expected_tokens: predicted committed tokens per request this step at ``block_size`` (mean over the batch).
    switched: ``block_size`` differs from the previous decision's.
    cost_table_version: version of the active cost table used (equal on all TP ranks by construction).
    probe: ``draft_full`` only to observe acceptance (b alone would have drafted less): its step time is not b's.
    widths: a ragged step -- request i drafts and verifies ``widths[i]`` positions (``block_size`` is the widest,
        ``draft_full`` False); None: every request verifies ``block_size``.
    """

    block_size: int
    draft_full: bool
    predicted_goodput: float
    expected_tokens: float
    switched: bool = False
    cost_table_version: int = 0
    probe: bool = False
    widths: tuple[int, ...] | None = None


# a relative rise of the acceptance evidence since the last probe that restarts the near-probe doubling. The evidence
# is the widest width's expected tokens per step over the current width's: it moves with acceptance only. (It was
# the goodput ratio, which the cost table moves too: 30 % step-time jitter at 16 requests restarted the doubling
# often enough to probe 3.9 % of width-1 steps instead of 1.9 %, benchmarks/probe_schedule.py --requests 16
# --noise 0.3, results/probe_schedule_16.json; one request: 4.6 % and 27 steps, results/probe_schedule.json.)
# The threshold, chosen with the goodput-ratio rule (one request, acceptance 0.2 -> 0.9 a position, 40 seeds):
# 0.05 probed 4.2 % of width-1 steps and turned drafting on after 30 steps on average (before the doubling, 20
# seeds: 12 %, 27 steps); 0.1 and 0.2 probed 3.5-3.8 % but took 35-40 steps
PROBE_SURPRISE = 0.05

# A decision's goodput estimate is reused for up to this many decisions while nothing it reads changed except the
# acceptance counts' per-step decay (a request's evidence loses 1 % a step: 8 steps shift its weight against the
# prior by under 8 %). Why: with speculation off (width 1) no step observes acceptance, yet recomputing the
# estimate cost ~230 us of every decode step in the server (cache-cold numpy: measured 204 us for decide in a CPU
# server at 1 request, 2 % of a width-1 step), for the same answer.
GOODPUT_REUSE_STEPS = 8


class BlockSizeController:
    """Adaptive / fixed / scheduled choice of the verify width (see module docstring for the contracts)."""

    def __init__(
        self,
        cfg: ControllerConfig,
        cost: CostModel,
        max_block: int = 16,
        is_rank0: bool = True,
        *,
        initial_capacity: int = 64,
        prefix_drafts: bool = False,
    ) -> None:
        """``prefix_drafts``: the worker drafts only the verified positions at 1 < b < max_block (see probes)."""
        cfg.validate()
        cfg.check_against_max_block(max_block)
        self.cfg = cfg
        self.cost_model = cost
        self.max_block = int(max_block)
        self.is_rank0 = bool(is_rank0)
        self.prefix_drafts = bool(prefix_drafts)
        cands = list(cfg.candidates_for(max_block))
        missing = [b for b in cands if b not in cost.block_sizes]
        if missing:
            raise ValueError(f"candidates: {missing} have no column in the cost model {cost.block_sizes}")
        self.candidates: tuple[int, ...] = tuple(cands)
        self._cands = np.asarray(cands, dtype=np.int64)
        self._cost_idx = np.asarray([cost.block_sizes.index(b) for b in cands], dtype=np.intp)
        self._index = {b: k for k, b in enumerate(cands)}
        self.tree_widths: tuple[int, ...] = tuple(b for b in cands if b > self.max_block)
        self._tree_rows = np.asarray([self._index[b] for b in self.tree_widths], dtype=np.intp)
        self._chain_cands = np.minimum(self._cands, self.max_block)  # a tree's tokens start from chain B's
        self._widest_chain = max(k for k, b in enumerate(cands) if b <= self.max_block)  # config: one exists
        self.tree_gain = tuple(TreeGain(self.tree_widths, decay=cfg.global_decay) for _ in range(PRIOR_CLASSES))
        cal_widths = calibrated_widths(cands, self.max_block, self.prefix_drafts)
        self.calibration = tuple(WidthCalibration(cal_widths, decay=cfg.global_decay) for _ in range(PRIOR_CLASSES))
        self._cal_rows = np.asarray([self._index[b] for b in cal_widths], dtype=np.intp)
        self._cal_widths = np.asarray(cal_widths, dtype=float)  # a width commits at most its own tokens
        self.J = self.max_block - 1
        self.slots = SlotMap(initial_capacity)
        cap = self.slots.capacity
        self.stats = AcceptanceStats(
            self.max_block,
            decay=cfg.decay,
            global_decay=cfg.global_decay,
            prior_strength=cfg.prior_strength,
            global_prior_mean=cfg.global_prior_mean,
            global_prior_strength=cfg.global_prior_strength,
            capacity=cap,
            classes=PRIOR_CLASSES,
        )
        self.hindsight = HindsightBuffer(self.max_block, cap) if self.J > 0 else None
        sched = cfg.schedule_map()
        self._sched_keys = sorted(sched)
        self._sched_vals = [sched[k] for k in self._sched_keys]
        # decision state (identical on all ranks: driven by identical call sequences)
        self._cur: int | None = None  # index into candidates
        self._dwell = 0
        self._since_draft = 0
        self._probe_backoff = 0  # near probes so far that left the best drafted width no nearer (doubling)
        self._excursion_from: int | None = None  # the width an exploration left, while it is away from it
        self._probe_evidence = float("inf")  # the acceptance evidence (_probe_interval) at the last probe
        self._last_bucket: int | None = None
        self.steps_decided = 0
        self.steps_observed = 0
        self.switches = 0
        self.skipped_probe_timings = 0
        self.explorations = 0
        self.ragged_steps = 0
        self._explored: dict[tuple[int, int], int] = {}
        self._under_cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._ok_for: tuple | None = None  # _explore: the inputs of the candidates it holds (`good` by identity)
        self._ok = np.zeros(0, dtype=bool)
        self._under_version = -1
        self._last_key: tuple = ()
        self._last_gen = -1
        self._last_slots = np.zeros(0, dtype=np.intp)
        self._obs_key: tuple | None = None  # _observe_elapsed: the last general observation's batch and classes,
        self._obs_gen = -1  # the slot map's generation after it
        self._obs_slots = np.zeros(0, dtype=np.intp)  # and its slots
        self._gp_key: tuple | None = None  # _goodput_reused: the inputs of the estimate it holds
        self._gp_step = 0
        self._gp_value: tuple[np.ndarray, np.ndarray, np.ndarray] = (np.zeros(0), np.zeros(0), np.zeros(0))
        self._ragged_for: tuple | None = None  # _ragged: the inputs of the value it holds (E by identity)
        self._ragged_value: tuple[tuple[int, ...], float, float] | None = None
        self._chain_rows = np.asarray([k for k, b in enumerate(cands) if b <= self.max_block], dtype=np.intp)

    # -- decision ---------------------------------------------------------------------------------------------
    def _probe_interval(self, good: np.ndarray, tokens: np.ndarray, k: int, bs: int) -> tuple[int, float]:
        """(steps between probes at candidate ``k``, the widest width's expected tokens / ``k``'s): shorter while a
        wider width's goodput is within reach, doubling after every probe that left the acceptance evidence no
        higher; the far interval stretched by the batch's rows (PROBE_ROWS)."""
        cfg = self.cfg
        far = self._far_probe_interval(bs)
        if cfg.probe_near_interval > 0 and k + 1 < len(good) and good[k] > 0:
            evidence = float(tokens[k + 1:].max()) / float(tokens[k])
            if float(good[k + 1:].max()) >= cfg.probe_near_ratio * float(good[k]):
                if evidence > self._probe_evidence * (1.0 + PROBE_SURPRISE):
                    self._probe_backoff = 0  # acceptance moved toward drafting since the last probe: look again
                return min(far, cfg.probe_near_interval << self._probe_backoff), evidence
            return far, evidence
        return far, 0.0

    def _far_probe_interval(self, bs: int) -> int:
        return self.cfg.probe_interval * min(PROBE_STRETCH_MAX, max(1, bs // PROBE_ROWS))

    def _scheduled_block(self, bs: int) -> int:
        i = bisect.bisect_right(self._sched_keys, bs) - 1
        return self._sched_vals[max(i, 0)]

    def _lookup(self, request_ids: Sequence[Hashable]) -> np.ndarray:
        """Slots of the batch; reuses the previous lookup when the batch and the slot map are unchanged."""
        key = tuple(request_ids)
        if key == self._last_key and self._last_gen == self.slots.generation:
            return self._last_slots
        slots = self.slots.lookup(key)
        self._last_key, self._last_gen, self._last_slots = key, self.slots.generation, slots
        return slots

    def goodput(self, request_ids: Sequence[Hashable],
                sampled: Sequence[bool] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(predicted batch goodput tokens/s, expected batch tokens) for every candidate; no state change.
        ``sampled``: which requests sample (temperature > 0; None: all greedy) -- each starts from its class's
        prior."""
        return self._estimate(request_ids, sampled)[:2]

    def _estimate(self, request_ids: Sequence[Hashable],
                  sampled: Sequence[bool] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``goodput()`` and the per-request estimate it sums, E [candidates, bs]."""
        bs = len(request_ids)
        slots = self._lookup(request_ids)
        classes = _classes(sampled, bs)
        E = self.stats.expected_tokens_t(slots, self._chain_cands, classes)  # [candidates, bs]
        if self._tree_rows.size:
            gain = self.tree_gains()  # [classes, trees]
            g = gain[0][:, None] if classes is None else gain[classes].T
            E[self._tree_rows] = np.maximum(1.0, E[self._tree_rows] + g)
        if self._cal_rows.size:  # after the trees: a tree's gain is measured against the uncalibrated chain B
            ratio = self.calibration_ratios()  # [classes, widths]
            r = ratio[0][:, None] if classes is None else ratio[classes].T
            E[self._cal_rows] = np.minimum(1.0 + (E[self._cal_rows] - 1.0) * r, self._cal_widths[:, None])
        tokens = E.sum(axis=1)
        eff = tokens
        if self.cfg.objective == "steady" and self._cur is not None and bs > 1:
            w = E[self._cur]
            eff = (bs * w.sum()) / (w / E).sum(axis=1)
        return eff / self.cost_model.row(bs)[self._cost_idx], tokens, E

    def _goodput_reused(self, request_ids: Sequence[Hashable],
                        sampled: Sequence[bool] | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``goodput()``, reused for up to GOODPUT_REUSE_STEPS decisions while none of its inputs changed except the
        counts' per-step decay: the batch and its classes, the slot map, the acceptance and tree-gain counts (their
        ``version``), the active cost table and the current width. The arrays are read-only."""
        key = (tuple(request_ids), None if sampled is None else tuple(sampled), self.slots.generation,
               self.stats.version, self._tree_gain_version(), self._calibration_version(), self.cost_model.version,
               self._cur)
        if key == self._gp_key and self.steps_decided - self._gp_step < GOODPUT_REUSE_STEPS:
            return self._gp_value
        good, tokens, E = self._estimate(request_ids, sampled)
        for a in (good, tokens, E):
            a.setflags(write=False)
        self._gp_key, self._gp_step, self._gp_value = key, self.steps_decided, (good, tokens, E)
        return good, tokens, E

    def _calibration_version(self) -> int:
        return sum(c.version for c in self.calibration)

    def _tree_gain_version(self) -> int:
        return sum(g.version for g in self.tree_gain)

    def tree_gains(self) -> np.ndarray:
        """[PRIOR_CLASSES, tree widths] the trees' learned tokens per request-step past chain B (tree_gain.py), for
        greedy and for sampled requests; widths in ``self.tree_widths``."""
        return np.stack([g.extra() for g in self.tree_gain])

    def calibration_ratios(self) -> np.ndarray:
        """[PRIOR_CLASSES, calibrated widths] observed / predicted accepted drafts (calibration.py); widths in
        ``self.calibration[0].widths``."""
        return np.stack([c.ratio() for c in self.calibration])

    def decide(self, request_ids: Sequence[Hashable], trees: bool = True,
               sampled: Sequence[bool] | None = None, ragged: bool = False) -> Decision:
        """Choose this step's block size for the batch ``request_ids`` (vectorised; ~tens of µs at batch 64);
        ``trees`` False: this batch cannot verify a tree (a tree width becomes the widest chain width);
        ``sampled``: which requests sample (None: all greedy; see PRIOR_CLASSES); ``ragged``: the worker can run a
        width per request this step (with ``per_request_widths``: ``_ragged``)."""
        bs = len(request_ids)
        version = self.cost_model.version
        if bs == 0:  # nothing to run; report the mode's block without changing any state
            if self.cfg.mode == "fixed":
                b = self.cfg.fixed_block
            elif self.cfg.mode == "schedule":
                b = self._scheduled_block(0)
            else:
                b = self._cands[self._cur] if self._cur is not None else self._cands[0]
            return Decision(int(b), False, 0.0, 0.0, False, version)  # type: ignore[arg-type]
        good, tokens, E = self._goodput_reused(request_ids, sampled)
        cfg = self.cfg
        cur = self._cur
        explored = False
        if cfg.mode == "fixed":
            k = self._index[cfg.fixed_block]  # type: ignore[index]
        elif cfg.mode == "schedule":
            k = self._index[self._scheduled_block(bs)]
        elif cfg.mode == "cycle":
            pattern = cfg.cycle_pattern
            k = (self._index[pattern[self.steps_decided % len(pattern)]] if pattern
                 else self.steps_decided % len(self.candidates))
        else:
            best = int(good.argmax())
            bucket = self.cost_model.bucket_index(bs)
            may_switch = self._dwell >= cfg.min_dwell_steps or bucket != self._last_bucket
            if cur is None:
                k = best
            elif best != cur and may_switch and good[best] > good[cur] * (1.0 + cfg.hysteresis):
                k = best
            else:
                k = cur
                if may_switch and cfg.explore_margin > 0.0:
                    k = self._explore(bs, bucket, good, cur)
                    explored = k != cur
            self._last_bucket = bucket
        if not trees and self._cands[k] > self.max_block:
            k = self._widest_chain
        switched = cur is not None and k != cur
        if switched:
            self.switches += 1
        self._dwell = 1 if (cur is None or switched) else self._dwell + 1
        self._cur = k
        b = int(self._cands[k])
        draft_full = b >= self.max_block or (b > 1 and not self.prefix_drafts)
        ragged_step = None
        if ragged and cfg.per_request_widths and cfg.mode == "cycle" and bs > 1:  # a test mode: only when asked
            ragged_step = self._ragged_cycle(E, bs)
        elif (ragged and cfg.per_request_widths and cfg.mode == "adaptive" and bs > 1
              and b <= self.max_block and not explored):  # an exploration measures a cell ragged steps price from
            ragged_step = self._ragged(E, tokens, k, bs)
        if ragged_step is not None:
            draft_full = False  # a ragged step drafts each request's own width; probes stay on their clock
        probe = False
        if switched or cur is None:
            # an exploration measures a cost cell, and going back to the width it left is no news about acceptance:
            # neither restarts the near probes (a restart cost up to ~4 extra probes an excursion: prose, 4 users, CPU)
            if not (explored or (k == self._excursion_from and self._excursion_from is not None)):
                self._probe_backoff, self._probe_evidence = 0, float("inf")
            self._excursion_from = cur if explored else None
        elif self._dwell > cfg.min_dwell_steps:
            self._excursion_from = None  # kept past its dwell: the tried width was adopted, leaving it is a switch
        if not draft_full and cfg.mode == "adaptive" and cfg.probe_interval > 0 and self.hindsight is not None:
            interval, evidence = self._probe_interval(good, tokens, k, bs)
            probe = draft_full = self._since_draft + 1 >= interval
            if draft_full:
                self._probe_evidence = evidence
                if interval < self._far_probe_interval(bs):  # a near probe below the cap: the next one waits longer
                    self._probe_backoff += 1
        self._since_draft = 0 if draft_full else self._since_draft + 1
        self.steps_decided += 1
        if ragged_step is not None and not probe:
            widths, g, e = ragged_step
            self.ragged_steps += 1
            return Decision(max(widths), False, g, e, switched, version, False, widths)
        return Decision(b, draft_full, float(good[k]), float(tokens[k] / bs), switched, version, probe)

    def _ragged_cycle(self, E: np.ndarray, bs: int) -> tuple[tuple[int, ...], float, float] | None:
        """``cycle`` mode's ragged step (a test of every mix of widths): request i verifies the pattern's entry
        i steps ahead of this step's, trees as the widest chain; None when that gives every request one width."""
        pattern = self.cfg.cycle_pattern or self.candidates
        at, widest = self.steps_decided, int(self._cands[self._widest_chain])
        widths = tuple(int(w) if w <= widest else widest
                       for w in (pattern[(at + i) % len(pattern)] for i in range(bs)))
        if len(set(widths)) == 1:
            return None
        e = E[[self._index[w] for w in widths], np.arange(bs)]
        return widths, 0.0, float(e.mean())

    def _ragged(self, E: np.ndarray, tokens: np.ndarray, k: int,
                bs: int) -> tuple[tuple[int, ...], float, float] | None:
        """(per-request widths, predicted goodput, mean expected tokens) of the best ragged step, or None when it
        predicts no more than ``hysteresis`` over this step's batch-wide width ``k`` or gives every request one
        width. Both are scored by this step's goodput, sum_r E_r / T (per-request widths are what the steady
        objective's harmonic weighting stands in for); the ragged step is priced from the batch's measured (or
        profiled) cost cells at its mean width (ragged.py). Reused while the (reused) estimate, k and the cost table
        are unchanged (the assignment alone: 30-41 us at 4-64 requests)."""
        key = (k, bs, self.cost_model.version)
        if self._ragged_for is not None and self._ragged_for[0] is E and self._ragged_for[1:] == key:
            return self._ragged_value
        self._ragged_for, self._ragged_value = (E, *key), self._ragged_assign(E, tokens, k, bs)
        return self._ragged_value

    def _ragged_assign(self, E: np.ndarray, tokens: np.ndarray, k: int,
                       bs: int) -> tuple[tuple[int, ...], float, float] | None:
        rows = self._chain_rows
        widths = self._cands[rows]
        cost = self.cost_model.row(bs)[self._cost_idx][rows]
        counts, age = self.cost_model.active_evidence(bs)
        fresh = ((counts[self._cost_idx][rows] >= max(4, self.cfg.min_dwell_steps))
                 & (age[self._cost_idx][rows] <= self.cfg.explore_stale_measurements))
        priced = (widths >= 2) & (fresh | self.cost_model.active_seed_measured)
        start = float(tokens[k]) / float(self.cost_model.row(bs)[self._cost_idx][k]) * (1.0 + self.cfg.hysteresis)
        floor = float(cost[0]) if widths[0] == 1 else 0.0
        picks, g = assign(E[rows].T, widths, (widths[priced], cost[priced]), floor, start)
        if g <= 0.0 or picks.min() == picks.max():
            return None
        e = E[rows][picks, np.arange(bs)]
        return tuple(int(w) for w in widths[picks]), g, float(e.mean())

    def _explore(self, bs: int, bucket: int, good: np.ndarray, cur: int) -> int:
        """Try a near-best block whose step time was never (or long ago) measured at this load, once per cooldown.

        Why: an unmeasured cell's cost is extrapolated; if extrapolation overstates it the block is never chosen
        and never measured (a pessimism trap). Depends only on the broadcast table and step counters (TP-safe).
        """
        version = self.cost_model.version
        if self._under_version != version:
            self._under_cache.clear()
            self._under_version = version
        cached = self._under_cache.get(bucket)
        if cached is None:
            counts, age = self.cost_model.active_evidence(bs)
            counts, age = counts[self._cost_idx], age[self._cost_idx]
            need = max(4, self.cfg.min_dwell_steps)
            under = (counts < need) | (age > self.cfg.explore_stale_measurements)
            # a modelled (not profiled) seed says little: measure every never-measured cell once unless it predicts
            # less than NEVER_FLOOR of the current width, or the width was measured at a load near this one
            never = (counts == 0) & (not self.cost_model.active_seed_measured)
            if never.any():
                never &= ~self.cost_model.active_measured_near(bs)[self._cost_idx]
            cached = (under, never)
            self._under_cache[bucket] = cached
        under, never = cached
        if not under.any():
            return cur
        if self._ok_for is not None and self._ok_for[0] is good and self._ok_for[1:] == (cur, bucket, version):
            ok = self._ok  # the same (reused) estimate, width, bucket and table: the same candidates
        else:
            near = good >= good[cur] * (1.0 - self.cfg.explore_margin)
            ok = (under & near) | (never & (good >= good[cur] * NEVER_FLOOR))
            ok[cur] = False
            self._ok_for, self._ok = (good, cur, bucket, version), ok
        if not ok.any():
            return cur
        cooldown = 4 * max(self.cfg.cost_sync_interval, self.cfg.min_dwell_steps)
        for k in np.argsort(-good):
            k = int(k)
            if ok[k] and self.steps_decided - self._explored.get((bucket, k), -(10**18)) >= cooldown:
                self._explored[(bucket, k)] = self.steps_decided
                self.explorations += 1
                return k
        return cur

    # -- observations (identical on all ranks) -----------------------------------------------------------------
    def observe_step(
        self,
        request_ids: Sequence[Hashable],
        block_size: int,
        accepted: np.ndarray | Sequence[int],
        drafted: np.ndarray | None,
        committed: Sequence[Sequence[int]],
        sampled: Sequence[bool] | None = None,
        widths: Sequence[int] | None = None,
    ) -> None:
        """Feed one verified step.

        accepted[i]: draft tokens accepted for request i (0..block_size-1).
        drafted: [bs, max_block-1] full drafted block after the anchor, or None when the draft was skipped.
        committed[i]: the tokens committed for request i this step (len = accepted[i] + 1).
        sampled[i]: request i samples (temperature > 0); None: every request is greedy. It picks the prior class
        whose global counts the request's observations feed (PRIOR_CLASSES).
        widths[i]: a ragged step's width of request i (``Decision.widths``; ``block_size`` its widest): its verify
        result is censored at widths[i] (it drafted no further).
        With a full drafted block, hindsight (drafted vs committed stream) is the only acceptance observation for
        that block: it subsumes the censored verify result, so the step is never counted twice. Without one, the
        verify result is recorded censored at width block_size.
        """
        n = len(request_ids)
        b = int(block_size)
        if b == 1 and drafted is None and self._observe_elapsed(request_ids, accepted, committed, sampled):
            return
        if not (1 <= b <= self.max_block or b in self._index):
            raise ValueError(f"block_size: must be in 1..{self.max_block} or a tree candidate {self.tree_widths}, "
                             f"got {block_size!r}")
        acc = np.asarray(accepted, dtype=np.int64).reshape(-1)
        if acc.shape[0] != n:
            raise ValueError(f"accepted: expected {n} entries, got {acc.shape[0]}")
        if n == 0:
            return
        if acc.min() < 0 or acc.max() > b - 1:
            raise ValueError(f"accepted: values must be in 0..{b - 1} for block_size {b}")
        tried = np.full(n, b - 1, dtype=np.int64)
        if widths is not None:
            tried = np.asarray(widths, dtype=np.int64).reshape(-1) - 1
            if tried.shape != (n,) or tried.min() < 0 or tried.max() > b - 1 or drafted is not None:
                raise ValueError(f"widths: expected {n} widths in 1..{b} and no full drafted block, got {widths!r}")
            if (acc > tried).any():
                raise ValueError("accepted: a request accepted more drafts than its width verified")
        if len(committed) != n:
            raise ValueError(f"committed: expected {n} sequences, got {len(committed)}")
        counts = np.fromiter(map(len, committed), dtype=np.int64, count=n)
        if not np.array_equal(counts, acc + 1):
            raise ValueError("committed: each request must commit accepted + 1 tokens")
        if drafted is not None:
            drafted = np.asarray(drafted)
            if drafted.shape != (n, self.J):
                raise ValueError(f"drafted: expected shape ({n}, {self.J}), got {drafted.shape}")
        if len(set(request_ids)) != n:
            raise ValueError("request_ids: duplicate ids in one step")
        classes = _classes(sampled, n)

        slots, new, grew = self.slots.assign(request_ids)
        if grew:
            self.stats.resize(self.slots.capacity)
            if self.hindsight is not None:
                self.hindsight.resize(self.slots.capacity)
        if new.size:
            self.stats.reset(new)
            if self.hindsight is not None:
                self.hindsight.reset(new)
        if classes is not None:
            self.stats.set_classes(slots, classes)
        # what _observe_elapsed may take as known about the next step of the same batch
        self._obs_key = (tuple(request_ids), None if sampled is None else tuple(sampled))
        self._obs_gen, self._obs_slots = self.slots.generation, slots

        if widths is None and drafted is None and b in self.calibration[0]:  # a prefix draft (a probe drafts all)
            self._calibrate(b, slots, acc, classes)
        self.stats.step(slots)
        if drafted is not None and self.hindsight is not None:
            self.hindsight.add_blocks(slots, drafted)
        elif b > 1:
            self.stats.observe(slots, acc, tried)
        if self.hindsight is not None and self.hindsight.has_pending():  # nothing undecided: the stream is never read
            tokens = np.fromiter(chain.from_iterable(committed), dtype=np.int64, count=int(counts.sum()))
            self.hindsight.append(slots, counts, tokens)
            s, a, t = self.hindsight.resolve(slots)
            self.stats.observe(s, a, t)
        self.steps_observed += 1

    def _calibrate(self, b: int, slots: np.ndarray, acc: np.ndarray, classes: np.ndarray | None) -> None:
        """Feed width b's calibration with this step's accepted drafts against the estimate before the step."""
        predicted = self.stats.expected_tokens_t(slots, np.asarray([b]), classes)[0] - 1.0
        if classes is None:
            self.calibration[0].observe(b, acc, predicted)
            return
        for c in np.unique(classes):
            m = classes == c
            self.calibration[int(c)].observe(b, acc[m], predicted[m])

    def _observe_elapsed(self, request_ids: Sequence[Hashable], accepted: np.ndarray | Sequence[int],
                         committed: Sequence[Sequence[int]], sampled: Sequence[bool] | None) -> bool:
        """``observe_step`` of a width-1 step without a draft for the batch (and classes) the previous observation
        had, with no block awaiting hindsight: such a step observes no acceptance, only that a step elapsed (the
        decay). False, changing nothing: the general path must run.

        Why: speculation off is most steps at low acceptance, and the general path's checks and slot lookup cost
        ~200 us of a decode step in a CPU server (cache-cold numpy, measured in situ: ~290 us for observe_step at
        1 request, 2-3 % of a width-1 step). The batch was checked when it was first observed; what is checked
        here is this step's data."""
        if (self._obs_gen != self.slots.generation or not isinstance(committed, np.ndarray)
                or (self.hindsight is not None and self.hindsight.has_pending())
                or self._obs_key != (tuple(request_ids), None if sampled is None else tuple(sampled))):
            return False
        n = len(request_ids)
        acc = np.asarray(accepted)
        if acc.shape != (n,):
            raise ValueError(f"accepted: expected {n} entries, got shape {acc.shape}")
        if acc.any():
            raise ValueError("accepted: values must be in 0..0 for block_size 1")
        if committed.shape != (n, 1):
            raise ValueError("committed: each request must commit accepted + 1 tokens")
        self.stats.step(self._obs_slots)
        self.steps_observed += 1
        return True

    def observe_tree(self, width: int, request_ids: Sequence[Hashable], path: np.ndarray) -> None:
        """Feed one tree step of width ``width`` (after its ``observe_step``): ``path`` [bs, D] the walked node
        indices (-1 past the end). Every tree candidate no wider than ``width`` learns its gain over chain B: what
        it would have committed, less the request's expected chain-B tokens (tree_gain.py), in the request's prior
        class."""
        if int(width) not in self.tree_widths:
            raise ValueError(f"width: {width!r} is not a tree candidate {self.tree_widths}")
        slots = self.slots.lookup(tuple(request_ids))
        if not slots.all():  # slot 0: unknown
            raise ValueError("request_ids: observe_step the tree step before observe_tree (and before finish)")
        chain = self.stats.expected_tokens_t(slots, np.asarray([self.max_block]))[0]
        extra = tree_commits(path, self.tree_widths) + 1.0 - chain[:, None]
        observed = np.asarray(self.tree_widths) <= int(width)
        classes = self.stats.slot_class.take(slots)  # as the tree step's observe_step set them
        for c in np.unique(classes):
            self.tree_gain[int(c)].observe(extra[classes == c], observed)

    def finish(self, request_id: Hashable) -> None:
        """Forget a finished/aborted request; its undecided hindsight blocks go to the global counts, censored."""
        slot = self.slots.release(request_id)
        if slot is None:
            return
        if self.hindsight is not None:
            acc, tried = self.hindsight.flush(slot)
            self.stats.observe_global_only(acc, tried, int(self.stats.slot_class[slot]))
        self.stats.reset(np.asarray([slot], dtype=np.intp))

    # -- cost table (rank 0 measures; everyone loads the broadcast) -----------------------------------------------
    def observe_step_time(self, batch_size: int, block_size: int, seconds: float, *, probe: bool = False) -> None:
        """Rank 0 only: fold a measured step time into the cost learner (not into decisions until a sync).

        A probe (``Decision.probe``: a full draft width b alone would not have run) is not b's cost and is skipped.
        """
        if not self.is_rank0:
            raise RuntimeError(
                "observe_step_time is rank 0's: other TP ranks must only load() the cost table rank 0 broadcasts"
            )
        if probe:
            self.skipped_probe_timings += 1
            return
        self.cost_model.observe(batch_size, block_size, seconds)

    @property
    def cost_sync_due(self) -> bool:
        """True every ``cost_sync_interval`` observed steps (same answer on every rank)."""
        return self.steps_observed > 0 and self.steps_observed % self.cfg.cost_sync_interval == 0

    def sync_cost_table(self, broadcast: Callable[[Any], Any] | None = None) -> int:
        """Collective: rank 0 exports its learned table, ``broadcast`` delivers rank 0's object to every rank
        (e.g. a wrapper of ``torch.distributed.broadcast_object_list``), and every rank loads it.

        With a single rank, ``broadcast`` may be None. Returns the active table version.
        """
        payload = self.cost_model.export() if self.is_rank0 else None
        if broadcast is not None:
            payload = broadcast(payload)
        elif not self.is_rank0:
            raise RuntimeError("sync_cost_table: a non-rank-0 controller needs a broadcast function")
        self.cost_model.load(payload)
        return self.cost_model.version

    # -- metrics helpers -------------------------------------------------------------------------------------------
    @property
    def current_block(self) -> int | None:
        """Block size of the last decision (None before the first)."""
        return None if self._cur is None else int(self._cands[self._cur])

    def acceptance_probabilities(self) -> np.ndarray:
        """Global p_j, j = 1..max_block-1, every class's counts pooled (copy)."""
        return self.stats.global_p().copy()

    def expected_tokens(self, request_ids: Sequence[Hashable]) -> np.ndarray:
        """E_r(b) per request and candidate -> [bs, len(candidates)] (for metrics and tests)."""
        return self.stats.expected_tokens(self.slots.lookup(request_ids), self._cands)

    @property
    def live_requests(self) -> int:
        """Requests holding a slot (should equal the running batch)."""
        return len(self.slots)
