"""The block-size controller: picks the verify width b for every decode step (the façade over its parts).

Why: the best b shrinks as load grows and depends on what the requests are; a fixed b is wrong somewhere
(docs/ADAPTIVE.md). The parts, each with its own contract: the goodput estimate (estimate.py), the decision rule
(width_rule.py), exploration (exploration.py), the probe schedule (probes.py), per-request widths
(ragged_overlay.py) and what the verified steps taught (request_state.py).

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
  1. ``d = decide(request_ids, trees, sampled, ragged)``: verify width ``d.block_size`` (above max_block: a tree of
     b - 1 draft prefixes; ``trees`` False: the batch cannot verify a tree, so none is chosen; ``d.widths``: a width
     per request, the widest being ``d.block_size``, only when ``ragged``: the worker can run that this step);
     draft the full block iff ``d.draft_full``; else draft nothing at b = 1 and, with ``prefix_drafts``, only the
     first b positions at b > 1 (``d.probe``: a full draft the width alone would not have run, probes.py).
  2. after the step's results are on the host: ``observe_step(request_ids, b, accepted, drafted, committed,
     sampled, widths)`` (``drafted`` = the full drafted block [bs, max_block - 1], or None unless ``d.draft_full``;
     a width-1 step without a draft, one token per request: ``observe_plain(request_ids, sampled)`` first, the data
     only where it answers False;
     ``sampled``: which requests sample, as given to decide -- the prior class, PRIOR_CLASSES), and on rank 0
     ``observe_step_time(bs, b, seconds, probe=d.probe)`` (a ragged step: ``observe_ragged_time(bs, d.widths,
     seconds)``); after a tree step also ``observe_tree(b, request_ids,
     path)``. With overlap scheduling these arrive one step late; that is fine.
  3. ``finish(request_id)`` for every finished or aborted request (frees its slot).
  4. when ``cost_sync_due``: ``sync_cost_table(broadcast)`` on every rank.

Held plain decisions: a width-1 decision without a draft is repeated, without asking the parts, for as many
decisions as nothing it reads can change it -- the batch, its classes, ``trees`` and ``ragged`` as given, every
version of the cost table and the request state, the estimate's reuse (estimate.py), the dwell, exploration's
waits and cooldowns, the next probe. Held decisions are the ones the whole controller would take, with the state
changes it would make (dwell, the probe count). Why: speculation off is most steps where the drafter cannot guess,
and asking the whole controller every step cost a noticeable part of a plain step.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .candidates import Candidates
from .config import ControllerConfig
from .cost_model import CostModel
from .estimate import GoodputEstimator
from .exploration import Exploration
from .probes import ProbeSchedule
from .ragged_overlay import RaggedOverlay
from .request_state import PRIOR_CLASSES, RequestState, calibrated_widths
from .width_rule import Choice, WidthRule

# What the replaced drafter's acceptance is worth as the prior of the one swapped in: as many observations (a request's
# verified step or resolved block) per class. Why:
# a promoted drafter is the old one fine-tuned, and the gate found it within a few percent of it on the original mix;
# started from the flat prior instead, the controller served widths up to 8 after a swap while both drafters accept
# several more tokens a step at the full block (docs/BENCHMARKS.md, learning: where the gate and serving part).
SWAPPED_PRIOR_STEPS = 8.0

__all__ = ["PRIOR_CLASSES", "BlockSizeController", "Decision", "calibrated_widths"]


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


@dataclass
class _Hold:
    """A plain decision repeated without asking while its inputs hold (BlockSizeController.decide)."""

    inputs: tuple  # (request ids, sampled, trees, ragged) as decide was given them
    state: tuple[int, ...]  # BlockSizeController._state() when it was taken
    decision: Decision  # the decision, not switched
    left: int  # decisions it may still answer


class BlockSizeController:
    """Adaptive / fixed / scheduled / cycled choice of the verify width (module docstring: the contracts)."""

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
        """``prefix_drafts``: the worker drafts only the verified positions at 1 < b < max_block (probes.py)."""
        cfg.validate()
        cfg.check_against_max_block(max_block)
        self.cfg = cfg
        self.cost_model = cost
        self.max_block = int(max_block)
        self.is_rank0 = bool(is_rank0)
        self.prefix_drafts = bool(prefix_drafts)
        self._cands = Candidates.resolve(cfg, cost, self.max_block)
        self.candidates: tuple[int, ...] = self._cands.widths
        self.tree_widths: tuple[int, ...] = self._cands.tree_widths
        self.requests = RequestState(cfg, self._cands, initial_capacity=initial_capacity,
                                     prefix_drafts=self.prefix_drafts)
        # the learned state, for metrics and tests (each object lives as long as the controller)
        self.slots, self.stats, self.hindsight = self.requests.slots, self.requests.stats, self.requests.hindsight
        self.tree_gain, self.calibration = self.requests.tree_gain, self.requests.calibration
        # the observations (identical on all ranks) go straight to the request state, which documents them
        self.observe_step = self.requests.observe_step
        self.observe_plain = self.requests.observe_plain
        self.plain_applies = self.requests.plain_applies
        self.observe_tree = self.requests.observe_tree
        self.finish = self.requests.finish
        self.estimator = GoodputEstimator(cfg, cost, self._cands, self.requests)
        self.rule = WidthRule(cfg, cost, self._cands)
        self.exploration = Exploration(cfg, cost, self._cands)
        self.probes = ProbeSchedule(cfg, self.max_block, cost)
        self.overlay = RaggedOverlay(cfg, cost, self._cands)
        self.steps_decided = 0
        self.skipped_probe_timings = 0
        self.held_decisions = 0
        self._hold: _Hold | None = None
        self._synced_at = 0  # steps_observed at the last cost-table sync

    def drafter_changed(self) -> None:
        """The drafter was hot-swapped: its global acceptance estimates become priors worth SWAPPED_PRIOR_STEPS
        observations (AcceptanceStats.soften_global), so the new drafter's own acceptance outweighs them within a
        few steps; the cost table stays (a step costs the same whatever the weights)."""
        self.stats.soften_global(SWAPPED_PRIOR_STEPS)

    # -- decision ---------------------------------------------------------------------------------------------
    def decide(self, request_ids: Sequence[Hashable], trees: bool = True,
               sampled: Sequence[bool] | None = None, ragged: bool = False) -> Decision:
        """Choose this step's width for the batch ``request_ids``; ``trees`` False: this batch cannot verify a tree;
        ``sampled``: which requests sample (None: all greedy; PRIOR_CLASSES); ``ragged``: the worker can run a
        width per request this step (with ``per_request_widths``: ragged_overlay.py)."""
        bs = len(request_ids)
        version = self.cost_model.version
        if bs == 0:  # nothing to run; report the mode's block without changing any state
            return Decision(self.rule.idle_block(), False, 0.0, 0.0, False, version)
        held = self.held(request_ids, trees, sampled, ragged)
        if held is not None:
            return held
        step = self.steps_decided
        good, tokens, E = self.estimator.reused(request_ids, sampled, self.rule.cur, step)
        fresh = self.requests.unmeasured_trees(sampled, bs) if trees else None
        choice = self.rule.choose(bs, good, trees, step, self.exploration, tokens, fresh)
        k = choice.k
        b = int(self._cands.array[k])
        draft_full = b >= self.max_block or (b > 1 and not self.prefix_drafts)
        ragged_step = self.overlay.pick(ragged, E, tokens, k, bs, step, choice.explored)
        if ragged_step is not None:
            draft_full = False  # a ragged step drafts each request's own width; probes stay on their clock
        probe = self.probes.due(choice, self.rule.dwell, draft_full, good, tokens, bs, self.requests.saturated)
        self.steps_decided += 1
        if ragged_step is not None and not probe:
            widths, g, e = ragged_step
            self.overlay.steps += 1
            return Decision(max(widths), False, g, e, choice.switched, version, False, widths)
        decision = Decision(b, draft_full or probe, float(good[k]), float(tokens[k] / bs), choice.switched, version,
                            probe)
        if b == 1 and not decision.draft_full:
            left = self._quiet_steps(step, choice)
            if left > 0:
                self._hold = _Hold((list(request_ids), None if sampled is None else list(sampled), trees, ragged),
                                   self._state(), replace(decision, switched=False), int(left))
        return decision

    def held(self, request_ids: Sequence[Hashable], trees: bool = True, sampled: Sequence[bool] | None = None,
             ragged: bool = False) -> Decision | None:
        """``decide``'s answer when it repeats a held plain decision (module docstring), with the state changes
        ``decide`` makes for it; None, changing nothing but dropping a hold that no longer applies, when ``decide``
        would ask the parts."""
        hold = self._hold
        if hold is None:
            return None
        if hold.left > 0 and hold.inputs == (request_ids, sampled, trees, ragged) and hold.state == self._state():
            hold.left -= 1
            self.steps_decided += 1
            self.held_decisions += 1
            self.rule.hold()
            self.probes.hold(self.rule.dwell)
            return hold.decision
        self._hold = None
        return None

    def _state(self) -> tuple[int, ...]:
        """The versions of everything a decision reads besides the batch and the step count."""
        req = self.requests
        return (self.cost_model.version, req.slots.generation, req.stats.version, req.tree_gain_version(),
                req.calibration_version())

    def _quiet_steps(self, step: int, choice: Choice) -> float:
        """After a plain decision at decision ``step``: how many decisions that follow would repeat it, were the
        batch, its classes and every version ``_state`` reads unchanged -- the first that could differ is the one
        that recomputes the estimate, may switch or explore once the dwell is served, finds an exploration's wait
        or cooldown over, or probes."""
        cfg = self.cfg
        if cfg.mode == "cycle" or choice.k != choice.previous:  # a new width is an input of the next estimate
            return 0
        left = float(self.estimator.reuse_left(step))
        if cfg.mode == "adaptive":
            dwell = self.rule.dwell
            if dwell <= cfg.min_dwell_steps:
                left = min(left, cfg.min_dwell_steps - dwell)
            elif cfg.explore_margin > 0.0:
                left = min(left, self.exploration.quiet_until - step - 1)
            left = min(left, self.probes.quiet_steps())
        return left

    def goodput(self, request_ids: Sequence[Hashable],
                sampled: Sequence[bool] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(predicted batch goodput tokens/s, expected batch tokens) for every candidate; no state change.
        ``sampled``: which requests sample (None: all greedy) -- each starts from its class's prior."""
        return self.estimator.estimate(request_ids, sampled, self.rule.cur)[:2]

    # -- cost table (rank 0 measures; everyone loads the broadcast) -----------------------------------------------
    def observe_step_time(self, batch_size: int, block_size: int, seconds: float, *, probe: bool = False) -> None:
        """Rank 0 only: fold a measured step time into the cost learner (not into decisions until a sync).

        A probe (``Decision.probe``: a full draft width b alone would not have run) is not b's cost: what it adds
        over b's price is the probe's (probe_price.py).
        """
        if not self.is_rank0:
            raise RuntimeError(
                "observe_step_time is rank 0's: other TP ranks must only load() the cost table rank 0 broadcasts"
            )
        if probe:
            self.skipped_probe_timings += 1
            self.cost_model.observe_probe(batch_size, block_size, seconds)
            return
        self.cost_model.observe(batch_size, block_size, seconds)

    def observe_ragged_time(self, batch_size: int, widths: Sequence[int], seconds: float) -> None:
        """Rank 0 only: fold a ragged step's measured time (``widths``: its decision's) into the learner's line of
        ragged steps (ragged_price.py), which prices the next ones once broadcast."""
        if not self.is_rank0:
            raise RuntimeError(
                "observe_ragged_time is rank 0's: other TP ranks must only load() the cost table rank 0 broadcasts"
            )
        self.cost_model.observe_ragged(batch_size, int(sum(widths)), seconds)

    @property
    def cost_sync_due(self) -> bool:
        """True once ``cost_sync_interval`` steps were observed since the last sync (same answer on every rank:
        observations arrive one or several steps at a time, ControllerLoop's plain runs, identically on all)."""
        return self.steps_observed - self._synced_at >= self.cfg.cost_sync_interval

    @property
    def steps_to_sync(self) -> int:
        """Observed steps until ``cost_sync_due`` (0: due now)."""
        return max(0, self.cfg.cost_sync_interval - (self.steps_observed - self._synced_at))

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
        self._synced_at = self.steps_observed
        return self.cost_model.version

    # -- readouts (metrics and tests) -------------------------------------------------------------------------
    @property
    def current_block(self) -> int | None:
        """Block size of the last decision (None before the first)."""
        cur = self.rule.cur
        return None if cur is None else int(self._cands.array[cur])

    def acceptance_probabilities(self) -> np.ndarray:
        """Global p_j, j = 1..max_block-1, every class's counts pooled (copy)."""
        return self.stats.global_p().copy()

    def expected_tokens(self, request_ids: Sequence[Hashable]) -> np.ndarray:
        """E_r(b) per request and candidate -> [bs, len(candidates)] (for metrics and tests)."""
        return self.stats.expected_tokens(self.slots.lookup(request_ids), self._cands.array)

    def tree_gains(self) -> np.ndarray:
        """[PRIOR_CLASSES, tree widths] the trees' learned tokens per request-step past chain B (tree_gain.py), for
        greedy and for sampled requests; widths in ``self.tree_widths``."""
        return self.requests.tree_gains()

    def calibration_ratios(self) -> np.ndarray:
        """[PRIOR_CLASSES, calibrated widths] observed / predicted accepted drafts (calibration.py); widths in
        ``self.calibration[0].widths``."""
        return self.requests.calibration_ratios()

    @property
    def live_requests(self) -> int:
        """Requests holding a slot (should equal the running batch)."""
        return len(self.slots)

    @property
    def steps_observed(self) -> int:
        """Steps observed so far (the cost-sync clock, identical on every rank)."""
        return self.requests.steps_observed

    @property
    def switches(self) -> int:
        """Decisions that changed the width."""
        return self.rule.switches

    @property
    def explorations(self) -> int:
        """Widths tried for their step cost (exploration.py)."""
        return self.exploration.explorations

    @property
    def ragged_steps(self) -> int:
        """Decisions that gave each request its own width."""
        return self.overlay.steps
