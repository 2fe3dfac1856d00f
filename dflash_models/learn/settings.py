"""The learner's settings: what `dflash-serve learn` hands `python -m dflash_models.learn` as a JSON file.

service/learn.py writes it from the config's `learning:` section with every path resolved; every default is that
section's (service/config.py LearningConfig), so none is repeated here: a file missing a field, or carrying one
this version does not know, was written by another version of dflash-serve and is refused rather than guessed at.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path


@dataclass(frozen=True)
class LearnSettings:
    target: str  # the target model's directory (model.path)
    initial_drafter: str  # the config's drafter: version "initial"
    store_dir: str  # the capture store the servers write
    work_dir: str  # versions, the candidate, decisions.jsonl, the original mix's cache
    servers: list[str]  # base URLs a promoted drafter is hot-swapped into
    admin_key_env: str | None  # the environment variable holding the servers' admin key (None: no key)
    threads: int  # torch threads of the learner
    steps: int  # fine-tuning steps per round
    original_share: float  # share of each batch drawn from the original mix
    min_sequences: int  # captured requests needed before a round runs
    holdout_fraction: float  # the newest captured requests held out for the gate
    promote_margin: float  # the fraction by which the candidate must beat the serving drafter on recent traffic
    promote_confidence: float  # the share of bootstrap resamples in which the candidate must win
    max_original_loss: float  # the most a candidate may lose on the original mix, as a fraction
    interval_seconds: float  # `loop`: seconds between rounds
    metrics_port: int | None  # Prometheus port of the learner (None: no metrics server)
    device: str  # where the target and the drafter's training run (learning.device)
    dtype: str  # the target's dtype there, resolved (learning.dtype)
    dataset: str | None  # the operator's original mix, a JSONL file (None: the bundled pair's own)

    @classmethod
    def read(cls, path: str | Path) -> LearnSettings:
        data = json.loads(Path(path).read_text())
        known = {f.name for f in fields(cls)}
        missing, unknown = sorted(known - set(data)), sorted(set(data) - known)
        if missing or unknown:
            raise SystemExit(f"dflash-serve learn: {path} was written by another version of dflash-serve (missing "
                             f"{missing}, unknown {unknown}): run `dflash-serve learn` again to rewrite it")
        return cls(**data)
