"""The predicted goodput of every candidate width for a batch: what the decision rule scores.

Why: the estimate changes with the model of a step (acceptance, trees, calibration, cost, the objective), not with
how the decision rule, exploration or probes use it.

Contract: ``estimate(ids, sampled, cur)`` -> (good, tokens, E): E [candidates, bs] each request's expected
committed tokens per width (a tree: chain B's plus its class's learned gain, at least 1; with prefix drafts a
calibrated width's scaled by its class's ratio, at most the width); tokens = E summed over the batch; good = the
objective over the step cost T(B, b):
  * ``step``: sum_r E_r(b) / T(B, b), this step's goodput;
  * ``steady`` (default): B * H(b) / T(B, b), H(b) = sum_r w_r / sum_r (w_r / E_r(b)), w_r = E_r(c) at the current
    width c: in a busy server a request that accepts little stays in the batch longer, so the long-run goodput
    is the token-weighted harmonic mean of E_r(b), not this step's sum (docs/ADAPTIVE.md). Both equal at b = c, so
    hysteresis compares like with like; with one request, or before a first decision, they are identical.
``reused(...)`` returns the previous estimate for up to GOODPUT_REUSE_STEPS decisions while none of its inputs
changed except the counts' per-step decay (the batch and its classes, the slot map, the estimates' versions, the
active cost table, the current width); its arrays are read-only.
Invariants: reads only state identical on every TP rank; changes nothing the decisions read.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from .candidates import Candidates
from .config import ControllerConfig
from .cost_model import CostModel
from .request_state import RequestState, prior_classes

# Decisions reusing one estimate while only the decay moved (a request's evidence loses 1 % a step, so 8 steps
# shift its weight against the prior by under 8 %). Why: at width 1 no step observes acceptance, and recomputing
# the same answer costs a noticeable part of a width-1 step.
GOODPUT_REUSE_STEPS = 8

Estimate = tuple[np.ndarray, np.ndarray, np.ndarray]


class GoodputEstimator:
    """Per-candidate predicted goodput of a batch (module contract)."""

    def __init__(self, cfg: ControllerConfig, cost: CostModel, cands: Candidates, requests: RequestState) -> None:
        self.cfg = cfg
        self.cost_model = cost
        self.cands = cands
        self.requests = requests
        cal_widths = requests.calibration[0].widths
        self._cal_rows = np.asarray([cands.index[b] for b in cal_widths], dtype=np.intp)
        self._cal_widths = np.asarray(cal_widths, dtype=float)  # a width commits at most its own tokens
        self._last_key: tuple = ()
        self._last_gen = -1
        self._last_slots = np.zeros(0, dtype=np.intp)
        self._gp_key: tuple | None = None  # reused: the inputs of the estimate it holds
        self._gp_step = 0
        self._gp_value: Estimate = (np.zeros(0), np.zeros(0), np.zeros(0))

    def _lookup(self, request_ids: Sequence[Hashable]) -> np.ndarray:
        """Slots of the batch; reuses the previous lookup when the batch and the slot map are unchanged."""
        slots_map = self.requests.slots
        key = tuple(request_ids)
        if key == self._last_key and self._last_gen == slots_map.generation:
            return self._last_slots
        slots = slots_map.lookup(key)
        self._last_key, self._last_gen, self._last_slots = key, slots_map.generation, slots
        return slots

    def estimate(self, request_ids: Sequence[Hashable], sampled: Sequence[bool] | None,
                 cur: int | None) -> Estimate:
        """(good, tokens, E) for the batch with current candidate ``cur`` (module contract)."""
        bs = len(request_ids)
        slots = self._lookup(request_ids)
        classes = prior_classes(sampled, bs)
        E = self.requests.stats.expected_tokens_t(slots, self.cands.chain_widths, classes)  # [candidates, bs]
        tree_rows = self.cands.tree_rows
        if tree_rows.size:
            gain = self.requests.tree_gains()  # [classes, trees]
            g = gain[0][:, None] if classes is None else gain[classes].T
            E[tree_rows] = np.maximum(1.0, E[tree_rows] + g)
        if self._cal_rows.size:  # after the trees: a tree's gain is measured against the uncalibrated chain B
            ratio = self.requests.calibration_ratios()  # [classes, widths]
            r = ratio[0][:, None] if classes is None else ratio[classes].T
            E[self._cal_rows] = np.minimum(1.0 + (E[self._cal_rows] - 1.0) * r, self._cal_widths[:, None])
        tokens = E.sum(axis=1)
        eff = tokens
        if self.cfg.objective == "steady" and cur is not None and bs > 1:
            w = E[cur]
            eff = (bs * w.sum()) / (w / E).sum(axis=1)
        return eff / self.cost_model.row(bs)[self.cands.cost_idx], tokens, E

    def reused(self, request_ids: Sequence[Hashable], sampled: Sequence[bool] | None, cur: int | None,
               step: int) -> Estimate:
        """``estimate``, or the one it returned at most GOODPUT_REUSE_STEPS decisions (``step``) ago for the same
        inputs."""
        req = self.requests
        key = (tuple(request_ids), None if sampled is None else tuple(sampled), req.slots.generation,
               req.stats.version, req.tree_gain_version(), req.calibration_version(), self.cost_model.version, cur)
        if key == self._gp_key and step - self._gp_step < GOODPUT_REUSE_STEPS:
            return self._gp_value
        good, tokens, E = self.estimate(request_ids, sampled, cur)
        for a in (good, tokens, E):
            a.setflags(write=False)
        self._gp_key, self._gp_step, self._gp_value = key, step, (good, tokens, E)
        return good, tokens, E

    def reuse_left(self, step: int) -> int:
        """Decisions after decision ``step`` that ``reused`` would answer from the estimate it holds, its inputs
        unchanged."""
        return GOODPUT_REUSE_STEPS - 1 - (step - self._gp_step)
