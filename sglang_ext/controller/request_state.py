"""What the controller has learned from verified steps: per-request acceptance, the trees' gains, the widths'
calibration.

Why: the observations change with what the worker reports (accepted counts, drafted blocks, tree paths), not with
how a width is chosen; the decision side only reads the estimates held here.

Contract:
  * ``observe_step`` / ``observe_tree`` / ``finish`` are BlockSizeController's (policy.py: the worker's call
    order); the argument checks raise ``ValueError`` naming the argument.
  * A request's estimate starts from its prior class's global one (PRIOR_CLASSES: 0 greedy, 1 sampled).
  * A step with a full drafted block is observed through hindsight only (it subsumes the censored verify result),
    so no step is counted twice; without one the verify result is recorded censored at the step's width.
  * With prefix drafts, a width 1 < b < max_block's own (non-probe) steps calibrate its expected tokens, per class
    (calibration.py): a drafter proposes differently when it drafts fewer positions.
  * A tree step measures, for every narrower tree at once, its tokens less the request's expected chain-B tokens
    (tree_gain.py), per class.
Invariants: fed identical calls on every TP rank, so every rank holds identical estimates; ``version``s change
whenever an estimate the decisions read changes (except the per-step decay).
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence
from itertools import chain

import numpy as np

from .acceptance import AcceptanceStats
from .calibration import WidthCalibration
from .candidates import Candidates
from .config import ControllerConfig
from .hindsight import HindsightBuffer
from .slots import SlotMap
from .tree_gain import TreeGain, tree_commits

# Prior classes of the acceptance statistics (acceptance.py): 0 greedy requests, 1 sampled ones (``sampled`` in
# decide / observe_step).
PRIOR_CLASSES = 2


def calibrated_widths(candidates: Sequence[int], max_block: int, prefix_drafts: bool) -> tuple[int, ...]:
    """The widths a controller calibrates (calibration.py): those drafted as a prefix, whose draft is not the full
    one the acceptance curve mostly learns from."""
    return tuple(int(b) for b in candidates if 2 <= b < max_block) if prefix_drafts else ()


def prior_classes(sampled: Sequence[bool] | None, n: int) -> np.ndarray | None:
    """Per-request prior class (None: every request greedy)."""
    if sampled is None:
        return None
    cls = np.asarray(sampled, dtype=np.intp)
    if cls.shape != (n,):
        raise ValueError(f"sampled: expected {n} entries, got shape {cls.shape}")
    return cls


class RequestState:
    """Slots, acceptance statistics, hindsight, tree gains and width calibration of the live requests."""

    def __init__(self, cfg: ControllerConfig, cands: Candidates, *, initial_capacity: int,
                 prefix_drafts: bool) -> None:
        self.cands = cands
        self.max_block = cands.max_block
        self.J = self.max_block - 1
        self.tree_gain = tuple(TreeGain(cands.tree_widths, decay=cfg.global_decay) for _ in range(PRIOR_CLASSES))
        cal_widths = calibrated_widths(cands.widths, self.max_block, prefix_drafts)
        self.calibration = tuple(WidthCalibration(cal_widths, decay=cfg.global_decay) for _ in range(PRIOR_CLASSES))
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
        self.steps_observed = 0
        self.saturated = 0  # steps in a row at a prefix width whose every request accepted all it verified
        self._obs_key: tuple | None = None  # _observe_elapsed: the last general observation's batch and classes,
        self._obs_gen = -1  # the slot map's generation after it
        self._obs_slots = np.zeros(0, dtype=np.intp)  # and its slots

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
        sampled[i]: request i samples (temperature > 0); None: every request is greedy (its prior class).
        widths[i]: a ragged step's width of request i (``Decision.widths``; ``block_size`` its widest): its verify
        result is censored at widths[i] (it drafted no further).
        """
        n = len(request_ids)
        b = int(block_size)
        if b == 1 and drafted is None and self._observe_elapsed(request_ids, accepted, committed, sampled):
            return
        if not (1 <= b <= self.max_block or b in self.cands.index):
            raise ValueError(f"block_size: must be in 1..{self.max_block} or a tree candidate "
                             f"{self.cands.tree_widths}, got {block_size!r}")
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
        classes = prior_classes(sampled, n)

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
        self.saturated = self.saturated + 1 if (drafted is None and 1 < b < self.max_block
                                                and bool((acc >= tried).all())) else 0
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
        """``observe_step`` of a width-1 step without a draft, by ``observe_plain`` once this step's data is
        checked. False, changing nothing: the general path must run."""
        if not isinstance(committed, np.ndarray) or not self._elapsed_applies(request_ids, sampled):
            return False
        n = len(request_ids)
        acc = np.asarray(accepted)
        if acc.shape != (n,):
            raise ValueError(f"accepted: expected {n} entries, got shape {acc.shape}")
        if acc.any():
            raise ValueError("accepted: values must be in 0..0 for block_size 1")
        if committed.shape != (n, 1):
            raise ValueError("committed: each request must commit accepted + 1 tokens")
        return self.observe_plain(request_ids, sampled)

    def plain_applies(self, request_ids: Sequence[Hashable], sampled: Sequence[bool] | None) -> bool:
        """Whether ``observe_plain`` would take a plain step of this batch now (it changes nothing)."""
        return self._elapsed_applies(request_ids, sampled)

    def _elapsed_applies(self, request_ids: Sequence[Hashable], sampled: Sequence[bool] | None) -> bool:
        return (self._obs_gen == self.slots.generation
                and not (self.hindsight is not None and self.hindsight.has_pending())
                and self._obs_key == (tuple(request_ids), None if sampled is None else tuple(sampled)))

    def observe_plain(self, request_ids: Sequence[Hashable], sampled: Sequence[bool] | None = None,
                      steps: int = 1) -> bool:
        """``steps`` width-1 steps without a draft, each committing one token per request, of the batch (and
        classes) the previous observation had, with no block awaiting hindsight: such steps observe no acceptance,
        only that steps elapsed (the decay). False, changing nothing, otherwise: ``observe_step`` must be given
        their data.

        Why: speculation off is most steps at low acceptance, and the general path's checks and slot lookup are a
        noticeable part of a width-1 step (docs/ADAPTIVE.md). The batch was checked when it was first observed; the
        caller vouches for this step's shape (the worker's plain step: one token per request, nothing drafted)."""
        if not self._elapsed_applies(request_ids, sampled):
            return False
        self.stats.step(self._obs_slots, steps)
        self.steps_observed += steps
        self.saturated = 0
        return True

    def observe_tree(self, width: int, request_ids: Sequence[Hashable], path: np.ndarray) -> None:
        """Feed one tree step of width ``width`` (after its ``observe_step``): ``path`` [bs, D] the walked node
        indices (-1 past the end); every tree candidate no wider than ``width`` learns its gain (tree_gain.py)."""
        tree_widths = self.cands.tree_widths
        if int(width) not in tree_widths:
            raise ValueError(f"width: {width!r} is not a tree candidate {tree_widths}")
        slots = self.slots.lookup(tuple(request_ids))
        if not slots.all():  # slot 0: unknown
            raise ValueError("request_ids: observe_step the tree step before observe_tree (and before finish)")
        chain_b = self.stats.expected_tokens_t(slots, np.asarray([self.max_block]))[0]
        extra = tree_commits(path, tree_widths) + 1.0 - chain_b[:, None]
        observed = np.asarray(tree_widths) <= int(width)
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

    def tree_gains(self) -> np.ndarray:
        """[PRIOR_CLASSES, tree widths] the trees' learned tokens per request-step past chain B."""
        return np.stack([g.extra() for g in self.tree_gain])

    def unmeasured_trees(self, sampled: Sequence[bool] | None, n: int) -> np.ndarray:
        """[candidates] bool: a tree width no tree step has measured for one of the batch's prior classes (its
        estimated tokens are chain B's by the prior, not by evidence)."""
        out = np.zeros(len(self.cands.widths), dtype=bool)
        if self.cands.tree_rows.size:
            classes = prior_classes(sampled, n)
            present = [0] if classes is None else sorted(set(classes.tolist()))
            out[self.cands.tree_rows] = np.any([self.tree_gain[c].steps == 0 for c in present], axis=0)
        return out

    def calibration_ratios(self) -> np.ndarray:
        """[PRIOR_CLASSES, calibrated widths] observed / predicted accepted drafts."""
        return np.stack([c.ratio() for c in self.calibration])

    def tree_gain_version(self) -> int:
        return sum(g.version for g in self.tree_gain)

    def calibration_version(self) -> int:
        return sum(c.version for c in self.calibration)
