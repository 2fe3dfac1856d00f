"""Controller configuration: one frozen, validated record.

Why a separate module: the service layer (YAML config, CLI) builds this record without importing the numeric
code, and every validation error names the offending field so a user can fix their YAML.

Contract:
  * ``ControllerConfig(...)`` validates in ``__post_init__``; an invalid record cannot exist.
  * ``validate()`` raises ``ValueError`` whose message starts with ``"<field>: "``.
  * ``from_dict(d)`` accepts plain JSON/YAML data (lists for tuples, string keys for ``schedule``) and rejects
    unknown keys, naming them.
  * Bounds that depend on the drafter (``max_block``) are checked by ``check_against_max_block``, the one rule
    for widths: every listed candidate must be <= TREE_WINDOW_BLOCKS x the drafter's trained block (refused, never
    dropped). A width w <= max_block verifies the chain of the drafted block's first w - 1 tokens; a width
    w > max_block verifies a DDTree of the w - 1 most likely draft prefixes (sglang_ext/tree/): w target tokens per
    request either way, so one step-cost column per width. The service's preflight runs it with the checkpoint's
    block and the worker again at start-up (for `sglang serve` by hand). ``candidates_for(max_block)`` is the
    resolved list every consumer uses.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MODES = ("adaptive", "fixed", "schedule", "cycle")
# the widest verify, in drafter blocks: a tree of at most 4 x 16 - 1 = 63 prefixes on a 16-block drafter (DDTree's
# gains flatten past this while the verify keeps growing; benchmarks/tree_throughput.py)
TREE_WINDOW_BLOCKS = 4
OBJECTIVES = ("steady", "step")


def _fail(name: str, message: str) -> None:
    raise ValueError(f"{name}: {message}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(float(x))


@dataclass(frozen=True)
class ControllerConfig:
    """Settings of the adaptive block-size controller (docs/ARCHITECTURE.md §3); each field's docstring says what it
    means."""

    mode: str = "adaptive"
    """``adaptive`` (argmax of predicted goodput), ``fixed`` (always ``fixed_block``), ``schedule`` (``schedule``'s
    width for the batch size) or ``cycle`` (the candidates in order, or ``cycle_pattern``, one per decode step: a
    diagnostic and test mode that exercises every width switch, never a performance setting)."""
    candidates: tuple[int, ...] | None = None
    """Verify widths the worker has resources (CUDA graphs) for; strictly increasing, >= 1. None (auto): the powers
    of two below the drafter's trained block B, and B. A width above B (up to TREE_WINDOW_BLOCKS x B; on GPU opted
    in, sglang_ext/names.py GPU_TREES) verifies a DDTree of width - 1 draft prefixes."""
    hysteresis: float = 0.03
    """Relative predicted-goodput gain needed to switch away from the current width (0.03 = 3 %)."""
    min_dwell_steps: int = 8
    """Decisions to stay on a width before a switch is considered (waived when the batch-size bucket changes)."""
    decay: float = 0.99
    """Per-step decay of a request's acceptance counts (memory ~ 1 / (1 - decay) of its decode steps)."""
    global_decay: float = 0.99
    """Decay of a prior class's global acceptance counts (the prior of new requests and of rarely seen positions) at
    every step that observes the class: memory in observed steps, so a stretch at width 1 keeps what was learnt."""
    prior_strength: float = 8.0
    """k of the Beta prior that shrinks a request's acceptance estimate toward the global one."""
    global_prior_mean: float = 0.5
    """Mean of the Beta prior of the global estimate of position 1 before any data (position j's prior is position
    j - 1's estimate)."""
    global_prior_strength: float = 2.0
    """Strength of the Beta prior of the global estimate of every position."""
    probe_interval: int = 32
    """Steps between probes (a full draft at a width that drafts less, so acceptance keeps being observed),
    stretched for large batches (sglang_ext/controller/probes.py); 0 disables probing."""
    probe_budget: float = 0.01
    """The largest share of decode time far probes may take: the probe schedule spaces them by their measured extra
    time (sglang_ext/controller/probe_price.py) so that a workload the drafter cannot guess pays at most this for the
    chance to find out it can; near probes (a wider width close to paying) are not bounded by it."""
    probe_near_interval: int = 4
    """Steps between probes while a wider width is predicted within ``probe_near_ratio`` of the current one's
    goodput, expects more than ``hysteresis`` more tokens and would win if its drafts were accepted twice as often,
    doubling after each such probe up to ``probe_interval`` (probes.py); 0 disables."""
    probe_near_ratio: float = 0.7
    """How near (a fraction of the current width's predicted goodput) a wider width must be for near probes."""
    fixed_block: int | None = None
    """The width of ``fixed`` mode (must be a candidate)."""
    schedule: Any = None  # Mapping[int, int] | tuple[tuple[int, int], ...] | None; normalised to a tuple
    """``schedule`` mode's table ``{batch_size: width}``: the entry with the largest key <= the batch size applies,
    below the smallest key the smallest key's; stored as a sorted tuple of ``(batch_size, width)`` pairs."""
    cycle_pattern: tuple[int, ...] | None = None
    """The widths ``cycle`` mode walks, one per step, repeating (e.g. ``[1, 1, 1, 1, 1, 16]``: drafting pauses for
    five steps and resumes); every width must be a candidate. Unset: the candidates in order."""
    cost_ema: float = 0.1
    """Weight of a new step-time measurement in the cost table's EMA."""
    cost_sync_interval: int = 16
    """Observed steps between cost-table broadcasts across TP ranks."""
    objective: str = "steady"
    """How a width is scored: ``steady`` by the long-run goodput of a busy batch (token-weighted harmonic mean of
    the requests' expected tokens over the step cost), ``step`` by this step's goodput (sum over the step cost);
    sglang_ext/controller/estimate.py."""
    explore_margin: float = 0.1
    """Try a width whose step cost at this batch size is unmeasured or stale, for one dwell period, when its
    predicted goodput is within this fraction of the current width's (exploration.py); 0 disables."""
    explore_stale_measurements: int = 4096
    """A cost cell counts as stale after this many step-time measurements elsewhere."""
    per_request_widths: bool = False
    """Let a step verify a width per request (a ragged step, ragged_overlay.py) when that is predicted to beat the
    batch-wide width by more than ``hysteresis``, where the worker can run it (CPU, greedy or sampled batches, with
    penalties, logit_bias and logprobs too, without a grammar, custom logit processor or sampling mask; refused on
    a GPU). Off by default: side by side it has both won and lost against one width per batch (docs/ADAPTIVE.md)."""

    def __post_init__(self) -> None:
        # Normalise containers before validating so the stored record is hashable and canonical.
        cands = self.candidates
        if isinstance(cands, (list, tuple)):
            object.__setattr__(self, "candidates", tuple(cands))
        if isinstance(self.cycle_pattern, list):
            object.__setattr__(self, "cycle_pattern", tuple(self.cycle_pattern))
        sched = self.schedule
        if sched is not None:
            object.__setattr__(self, "schedule", _normalise_schedule(sched))
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError("<field>: ...")`` for the first invalid field."""
        if self.mode not in MODES:
            _fail("mode", f"must be one of {MODES}, got {self.mode!r}")
        c = self.candidates
        if c is not None:
            if not isinstance(c, tuple) or len(c) == 0:
                _fail("candidates", f"must be a non-empty sequence of ints (or unset for auto), got {c!r}")
            if not all(_is_int(b) and b >= 1 for b in c):
                _fail("candidates", f"every block size must be an int >= 1, got {c!r}")
            if any(b2 <= b1 for b1, b2 in zip(c, c[1:])):
                _fail("candidates", f"must be strictly increasing, got {c!r}")
        if not isinstance(self.per_request_widths, bool):
            _fail("per_request_widths", f"must be true or false, got {self.per_request_widths!r}")
        if not (_is_real(self.hysteresis) and 0.0 <= self.hysteresis < 1.0):
            _fail("hysteresis", f"must be a number in [0, 1), got {self.hysteresis!r}")
        if not (_is_int(self.min_dwell_steps) and self.min_dwell_steps >= 0):
            _fail("min_dwell_steps", f"must be an int >= 0, got {self.min_dwell_steps!r}")
        for name in ("decay", "global_decay"):
            v = getattr(self, name)
            if not (_is_real(v) and 0.0 < v <= 1.0):
                _fail(name, f"must be a number in (0, 1], got {v!r}")
        if not (_is_real(self.prior_strength) and self.prior_strength >= 0.0):
            _fail("prior_strength", f"must be a number >= 0, got {self.prior_strength!r}")
        if not (_is_real(self.global_prior_mean) and 0.0 <= self.global_prior_mean <= 1.0):
            _fail("global_prior_mean", f"must be a number in [0, 1], got {self.global_prior_mean!r}")
        if not (_is_real(self.global_prior_strength) and self.global_prior_strength > 0.0):
            _fail("global_prior_strength", f"must be a number > 0, got {self.global_prior_strength!r}")
        if not (_is_int(self.probe_interval) and self.probe_interval >= 0):
            _fail("probe_interval", f"must be an int >= 0 (0 disables probing), got {self.probe_interval!r}")
        if not (_is_real(self.probe_budget) and 0.0 < self.probe_budget <= 1.0):
            _fail("probe_budget", f"must be a number in (0, 1], got {self.probe_budget!r}")
        if not (_is_int(self.probe_near_interval) and self.probe_near_interval >= 0):
            _fail("probe_near_interval", f"must be an int >= 0 (0 disables), got {self.probe_near_interval!r}")
        if not (_is_real(self.probe_near_ratio) and 0.0 < self.probe_near_ratio <= 1.0):
            _fail("probe_near_ratio", f"must be a number in (0, 1], got {self.probe_near_ratio!r}")
        if not (_is_real(self.cost_ema) and 0.0 < self.cost_ema <= 1.0):
            _fail("cost_ema", f"must be a number in (0, 1], got {self.cost_ema!r}")
        if not (_is_int(self.cost_sync_interval) and self.cost_sync_interval >= 1):
            _fail("cost_sync_interval", f"must be an int >= 1, got {self.cost_sync_interval!r}")
        if not (_is_real(self.explore_margin) and 0.0 <= self.explore_margin < 1.0):
            _fail("explore_margin", f"must be a number in [0, 1), got {self.explore_margin!r}")
        if not (_is_int(self.explore_stale_measurements) and self.explore_stale_measurements >= 1):
            _fail("explore_stale_measurements", f"must be an int >= 1, got {self.explore_stale_measurements!r}")
        if self.objective not in OBJECTIVES:
            _fail("objective", f"must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.mode == "fixed":
            if self.fixed_block is None:
                _fail("fixed_block", "is required when mode is 'fixed'")
        if self.fixed_block is not None:
            if not (_is_int(self.fixed_block) and self.fixed_block >= 1):
                _fail("fixed_block", f"must be an int >= 1, got {self.fixed_block!r}")
            if c is not None and self.fixed_block not in c:
                _fail("fixed_block", f"{self.fixed_block} is not one of the candidates {c}")
        pattern = self.cycle_pattern
        if pattern is not None:
            if self.mode != "cycle":
                _fail("cycle_pattern", f"is used by mode 'cycle' only (mode is {self.mode!r})")
            if not isinstance(pattern, tuple) or not pattern or not all(_is_int(b) and b >= 1 for b in pattern):
                _fail("cycle_pattern", f"must be a non-empty sequence of ints >= 1, got {pattern!r}")
            if c is not None and not set(pattern) <= set(c):
                _fail("cycle_pattern", f"{sorted(set(pattern) - set(c))} are not among the candidates {c}")
        if self.mode == "schedule" and self.schedule is None:
            _fail("schedule", "is required when mode is 'schedule'")
        if self.schedule is not None:
            if not isinstance(self.schedule, tuple) or len(self.schedule) == 0:
                _fail("schedule", f"must be a non-empty mapping batch_size -> block, got {self.schedule!r}")
            for bs, blk in self.schedule:
                if not (_is_int(bs) and bs >= 1):
                    _fail("schedule", f"batch-size key must be an int >= 1, got {bs!r}")
                if not (_is_int(blk) and blk >= 1):
                    _fail("schedule", f"block for batch size {bs} must be an int >= 1, got {blk!r}")
                if c is not None and blk not in c:
                    _fail("schedule", f"block {blk!r} for batch size {bs} is not one of the candidates {c}")

    def candidates_for(self, max_block: int) -> tuple[int, ...]:
        """The widths in use with a drafter of trained block ``max_block`` (call ``check_against_max_block``
        first): the listed candidates, or auto = 1, 2, 4, ... below max_block, then max_block."""
        if self.candidates is not None:
            return self.candidates
        auto = [1 << k for k in range(max_block.bit_length()) if (1 << k) < max_block]
        return tuple(auto + [max_block])

    def check_against_max_block(self, max_block: int) -> None:
        """The one rule for widths: every width used must be <= TREE_WINDOW_BLOCKS x the drafter's trained
        block (above the block: a tree; refused, never silently dropped); fixed_block and the schedule's blocks
        must be among the resolved candidates."""
        if not (_is_int(max_block) and max_block >= 1):
            _fail("max_block", f"must be an int >= 1, got {max_block!r}")
        if self.candidates is not None:
            widest = TREE_WINDOW_BLOCKS * max_block
            too_wide = [b for b in self.candidates if b > widest]
            if too_wide:
                _fail("candidates", f"{too_wide} exceed {widest} = {TREE_WINDOW_BLOCKS} x the drafter's trained "
                                    f"block_size {max_block} (widths 1..{max_block} verify a chain, "
                                    f"{max_block + 1}..{widest} a tree of width - 1 draft prefixes); or leave "
                                    f"candidates unset (auto)")
            if not any(b <= max_block for b in self.candidates):
                _fail("candidates", f"{list(self.candidates)} has no chain width (1..{max_block}): a batch that "
                                    f"cannot verify a tree (grammar, logprobs, penalties) needs one; add {max_block}")
        cands = self.candidates_for(max_block)
        if self.fixed_block is not None and self.fixed_block not in cands:
            _fail("fixed_block", f"{self.fixed_block} is not one of the candidates {cands} (drafter block "
                                 f"{max_block})")
        if self.cycle_pattern is not None and not set(self.cycle_pattern) <= set(cands):
            _fail("cycle_pattern", f"{sorted(set(self.cycle_pattern) - set(cands))} are not among the candidates "
                                   f"{cands} (drafter block {max_block})")
        for bs, blk in self.schedule or ():
            if blk not in cands:
                _fail("schedule", f"block {blk} for batch size {bs} is not one of the candidates {cands} (drafter "
                                  f"block {max_block})")

    def tree_widths(self, max_block: int) -> tuple[int, ...]:
        """The candidates that verify a tree (wider than the drafter's block)."""
        return tuple(b for b in self.candidates_for(max_block) if b > max_block)

    def schedule_map(self) -> dict[int, int]:
        """The schedule as a plain dict (empty when unset)."""
        return dict(self.schedule or ())

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form; ``from_dict(cfg.to_dict()) == cfg``."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["candidates"] = None if self.candidates is None else list(self.candidates)
        d["schedule"] = None if self.schedule is None else {str(k): v for k, v in self.schedule}
        d["cycle_pattern"] = None if self.cycle_pattern is None else list(self.cycle_pattern)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ControllerConfig":
        """Build from plain data (parsed YAML/JSON); unknown keys are an error naming the key."""
        if not isinstance(d, Mapping):
            raise ValueError(f"config: expected a mapping, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            _fail(str(unknown[0]), f"unknown controller setting (known: {sorted(known)})")
        kwargs = dict(d)
        if "candidates" in kwargs and isinstance(kwargs["candidates"], list):
            kwargs["candidates"] = tuple(kwargs["candidates"])
        return cls(**kwargs)


def field_docs() -> dict[str, str]:
    """Each ControllerConfig field's docstring (the string under the field), by field name, whitespace folded: what
    a generated settings reference prints."""
    tree = ast.parse(inspect.getsource(ControllerConfig))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _normalise_schedule(sched: Any) -> tuple[tuple[int, int], ...]:
    """Accept a mapping (keys may be strings, as in JSON/YAML) or pairs; return sorted int pairs."""
    if isinstance(sched, Mapping):
        items = list(sched.items())
    elif isinstance(sched, (list, tuple)):
        items = []
        for it in sched:
            if not (isinstance(it, (list, tuple)) and len(it) == 2):
                _fail("schedule", f"entries must be (batch_size, block) pairs, got {it!r}")
            items.append((it[0], it[1]))
    else:
        _fail("schedule", f"must be a mapping batch_size -> block, got {type(sched).__name__}")
    out: dict[int, int] = {}
    for k, v in items:
        try:
            kk = int(k) if not isinstance(k, bool) else None
        except (TypeError, ValueError):
            kk = None
        if kk is None or (isinstance(k, float) and not float(k).is_integer()):
            _fail("schedule", f"batch-size key must be an integer, got {k!r}")
        if not _is_int(v):
            _fail("schedule", f"block for batch size {k!r} must be an int, got {v!r}")
        out[kk] = v
    return tuple(sorted(out.items()))
