"""The probe schedule: when a step that drafts less than the full block drafts it anyway, to keep learning.

Why: at width 1 the worker skips the draft and, with prefix drafts, a width 1 < b < max_block drafts only b
positions; hindsight (hindsight.py) learns acceptance from full drafted blocks only, so without probes the evidence
that would turn speculation back on (or widen) never arrives. A probe costs a draft forward, so it is rare unless
it may pay (docs/ADAPTIVE.md holds the evidence for the intervals and thresholds).

Contract (adaptive mode, ``probe_interval`` > 0, a drafter block above 1; a step that drafts the full block
anyway is never a probe and restarts the count):
  * far: a probe every ``probe_interval`` x min(PROBE_STRETCH_MAX, max(1, bs // PROBE_ROWS)) steps (one probe
    observes every request of the batch, so a larger batch needs fewer), and never more often than keeps the
    probes' measured extra time (probe_price.py, through the cost model) within ``probe_budget`` of the time of
    the steps between them at the current width: the bound on what probing costs a workload whose drafts are
    never accepted. Until a probe has been measured, the count alone. The interval doubles after each far probe
    that found the acceptance evidence (below) no higher than the probe before it did, up to FAR_BACKOFF_MAX
    doublings, and is back to one on a rise of more than PROBE_SURPRISE or a switch that is news: a workload whose
    probes keep finding nothing pays a fraction of the budget, one whose acceptance moves pays it whole.
  * near: while a wider width's predicted goodput is at least ``probe_near_ratio`` of the current width's, a
    wider width's expected tokens exceed the current width's by more than ``hysteresis`` (drafts never accepted:
    the far interval only) and a wider width would beat the current one by more than ``hysteresis`` if its drafts
    were accepted NEAR_GROWTH times as often as estimated (drafts rarely accepted at a width that costs much
    more: the far interval only), every ``probe_near_interval`` steps instead, that interval doubling after each near
    probe (up to the far one), and back to ``probe_near_interval`` when the acceptance evidence -- the widest
    width's expected tokens over the current width's -- has risen by more than PROBE_SURPRISE since the last
    probe, or when the width switches (neither to try a width, exploration.py, nor back to the width an
    exploration left: that is no news about acceptance).
  * saturated: after ``probe_near_interval`` steps in a row at a prefix-drafted width (1 < b < max_block) in
    which every request accepted all b - 1 drafts it verified, at once, and the near doubling restarts. Why: such
    steps say nothing about the positions past b, which the estimate then takes from the class's curve; a request
    far better than its class stayed narrow for a whole request (benchmarks/regret_offline.py, real-world code).
Invariants: depends only on the estimate and the call sequence (identical on every TP rank).
"""
from __future__ import annotations

import math

import numpy as np

from .config import ControllerConfig
from .cost_model import CostModel
from .width_rule import Choice

# the far interval's stretch: x min(PROBE_STRETCH_MAX, batch // PROBE_ROWS)
PROBE_ROWS = 8
PROBE_STRETCH_MAX = 4
# a relative rise of the acceptance evidence since the last probe that restarts the near-probe doubling; the
# evidence is a ratio of expected tokens, so it moves with acceptance only, not with the cost table's jitter
PROBE_SURPRISE = 0.05
# How much more often a wider width's drafts would have to be accepted than estimated for near probes to look for it.
# Why: a probe observes acceptance, so it is worth its price only while a change of acceptance it could plausibly
# find would change the width; at a load where a wider step costs far more than its drafts bring (prose at
# temperature 1 on a busy CPU) every near probe -- a draft of the whole batch's full block and its deferred draft
# KV, several steps' time -- found what the last one had (docs/BENCHMARKS.md, explorations and probes).
NEAR_GROWTH = 2.0
# Doublings of the far interval after far probes that found nothing new (at most 2**FAR_BACKOFF_MAX times the
# budget's spacing). Why: where the drafter cannot guess (prose at temperature 1) every far probe found what the
# last one had, and each costs its own price plus colder steps after it that the price does not count
# (docs/BENCHMARKS.md, plain runs).
FAR_BACKOFF_MAX = 2


class ProbeSchedule:
    """Whether this step probes (module contract)."""

    def __init__(self, cfg: ControllerConfig, max_block: int, cost: CostModel | None = None) -> None:
        self.cfg = cfg
        self.cost = cost
        self.enabled = cfg.mode == "adaptive" and cfg.probe_interval > 0 and max_block > 1
        self._since_draft = 0
        self._backoff = 0  # near probes so far that left the acceptance evidence no higher (doubling)
        self._far_backoff = 0  # far probes in a row that found the evidence no higher than the probe before
        self._excursion_from: int | None = None  # the width an exploration left, while it is away from it
        self._evidence = float("inf")  # the acceptance evidence at the last probe
        self._last_interval = math.inf  # the interval the last non-full-draft decision was held to

    def far_interval(self, bs: int, k: int | None = None) -> int:
        """Steps between far probes at batch size ``bs`` and candidate ``k`` (the current width's price), doubled
        for each far probe in a row that found nothing new (module contract)."""
        steps = self.cfg.probe_interval * min(PROBE_STRETCH_MAX, max(1, bs // PROBE_ROWS))
        extra = self.cost.probe_seconds(bs) if self.cost is not None and k is not None else None
        if extra:
            step = float(self.cost.row(bs)[k])
            steps = max(steps, math.ceil(extra / (self.cfg.probe_budget * step)))
        return steps << min(self._far_backoff, FAR_BACKOFF_MAX)

    def _interval(self, good: np.ndarray, tokens: np.ndarray, k: int, bs: int) -> tuple[int, float]:
        """(steps between probes at candidate ``k``, the acceptance evidence)."""
        cfg = self.cfg
        evidence = float(tokens[k + 1:].max()) / float(tokens[k]) if k + 1 < len(tokens) and tokens[k] > 0 else 0.0
        rose = evidence > self._evidence * (1.0 + PROBE_SURPRISE)  # acceptance moved toward drafting since the last
        if rose:  # probe: look again at the budget's pace
            self._far_backoff = 0
        far = self.far_interval(bs, k)
        if cfg.probe_near_interval > 0 and evidence > 0.0 and good[k] > 0:
            # near only where drafting could win: a wider width's goodput close, its tokens past hysteresis (with
            # drafts never accepted every wider width is near in goodput by its price alone), and a plausible rise
            # of its acceptance enough to pay for its step
            wider_good, wider_tokens = good[k + 1:], tokens[k + 1:]
            grown = wider_good * (bs + NEAR_GROWTH * (wider_tokens - bs)) / wider_tokens
            if (float(wider_good.max()) >= cfg.probe_near_ratio * float(good[k])
                    and evidence > 1.0 + cfg.hysteresis
                    and float(grown.max()) > float(good[k]) * (1.0 + cfg.hysteresis)):
                if rose:
                    self._backoff = 0
                return min(far, cfg.probe_near_interval << self._backoff), evidence
        return far, evidence

    def _note_far(self, evidence: float) -> None:
        """A far probe runs now: the one before it found nothing new if the evidence did not rise since (module
        contract; the first after a switch has no probe before it to judge)."""
        if math.isfinite(self._evidence) and not evidence > self._evidence * (1.0 + PROBE_SURPRISE):
            self._far_backoff += 1

    def _note(self, choice: Choice, dwell: int) -> None:
        """Restart the near doubling on a switch that is news about acceptance."""
        k, cur = choice.k, choice.previous
        if choice.switched or cur is None:
            if not (choice.explored or (k == self._excursion_from and self._excursion_from is not None)):
                self._backoff, self._far_backoff, self._evidence = 0, 0, float("inf")
            self._excursion_from = cur if choice.explored else None
        elif dwell > self.cfg.min_dwell_steps:
            self._excursion_from = None  # kept past its dwell: the tried width was adopted, leaving it is a switch

    def due(self, choice: Choice, dwell: int, draft_full: bool, good: np.ndarray, tokens: np.ndarray,
            bs: int, saturated: int = 0) -> bool:
        """Whether this decision (``draft_full``: its width drafts the full block anyway) probes; ``saturated``:
        the steps in a row, since the last full draft, in which every request accepted all its width verified."""
        self._note(choice, dwell)
        probe = False
        if not draft_full and self.enabled:
            interval, evidence = self._interval(good, tokens, choice.k, bs)
            if self.cfg.probe_near_interval > 0 and saturated >= self.cfg.probe_near_interval:
                self._backoff = 0  # the width is the limit, not the drafts: what lies beyond it is worth a look
                interval = 1
            probe = self._since_draft + 1 >= interval
            self._last_interval = interval
            if probe:
                if interval < self.far_interval(bs, choice.k):  # a near probe below the cap: the next one waits longer
                    self._backoff += 1
                elif interval > 1:  # a far probe (not a saturated width's look past it)
                    self._note_far(evidence)
                self._evidence = evidence
        self._since_draft = 0 if (draft_full or probe) else self._since_draft + 1
        return probe

    def quiet_steps(self) -> float:
        """After a decision that neither probed nor drafted the full block: the decisions that follow before one
        could probe, were the interval unchanged (its inputs: the estimate, the width, the batch size, the active
        table)."""
        if not self.enabled:
            return math.inf
        return self._last_interval - self._since_draft - 1

    def hold(self, dwell: int) -> None:
        """A decision that kept the current width and did not probe, without asking (policy.py): what ``due``
        changes for it."""
        if dwell > self.cfg.min_dwell_steps:
            self._excursion_from = None
        self._since_draft += 1
