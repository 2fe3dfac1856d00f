"""The candidate widths a controller chooses among, resolved once against the drafter and the cost table.

Why: every part of a decision (the rule, exploration, probes, the ragged overlay, the estimate) indexes the same
candidates and needs the same derived views of them; computing them in one place keeps those views in step.

Contract: ``Candidates.resolve(cfg, cost, max_block)`` -> the record below; raises ``ValueError`` naming
``candidates`` when a width has no column in the cost table. A candidate is addressed by its index ``k``
(``widths[k]``) everywhere in the controller.
Invariants: immutable after construction; at least one chain width (ControllerConfig.check_against_max_block).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import ControllerConfig
from .cost_model import CostModel


@dataclass(frozen=True)
class Candidates:
    """Candidate widths and their derived index views (arrays are read, never written)."""

    widths: tuple[int, ...]
    max_block: int
    array: np.ndarray  # widths as int64
    index: dict[int, int]  # width -> k
    cost_idx: np.ndarray  # k -> column of the cost table
    tree_widths: tuple[int, ...]  # widths above max_block: DDTrees
    tree_rows: np.ndarray  # their k
    chain_widths: np.ndarray  # per k, the chain width whose tokens the estimate starts from (a tree: max_block)
    chain_rows: np.ndarray  # k of the chain widths (<= max_block)
    widest_chain: int  # k of the widest chain width: what a batch that cannot verify a tree runs instead

    @classmethod
    def resolve(cls, cfg: ControllerConfig, cost: CostModel, max_block: int) -> "Candidates":
        """The candidates of ``cfg`` with a drafter of trained block ``max_block``, priced by ``cost``."""
        cands = list(cfg.candidates_for(max_block))
        missing = [b for b in cands if b not in cost.block_sizes]
        if missing:
            raise ValueError(f"candidates: {missing} have no column in the cost model {cost.block_sizes}")
        array = np.asarray(cands, dtype=np.int64)
        index = {b: k for k, b in enumerate(cands)}
        trees = tuple(b for b in cands if b > max_block)
        return cls(
            widths=tuple(cands),
            max_block=max_block,
            array=array,
            index=index,
            cost_idx=np.asarray([cost.block_sizes.index(b) for b in cands], dtype=np.intp),
            tree_widths=trees,
            tree_rows=np.asarray([index[b] for b in trees], dtype=np.intp),
            chain_widths=np.minimum(array, max_block),
            chain_rows=np.asarray([k for k, b in enumerate(cands) if b <= max_block], dtype=np.intp),
            widest_chain=max(k for k, b in enumerate(cands) if b <= max_block),
        )
