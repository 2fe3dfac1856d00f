"""`dflash-serve learn`: the config's `learning:` section turned into the learner's settings, and the learner run as
its own process (`python -m dflash_models.learn`, exec'd in place of `dflash-serve learn`, so the service package never imports the training code; its
torch threads are `learning.threads`, never the servers').

Servers to hot-swap: `learning.servers`; else with `--fleet` every replica of the config's fleet (the router is not
one: a swap goes to each replica); else the config's server.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from service.config import ConfigError, ServeConfig

ACTIONS = ("round", "loop", "rollback", "status")


def _local(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def servers(config: ServeConfig, fleet: bool = False) -> list[str]:
    if config.learning.servers:
        return [s.rstrip("/") for s in config.learning.servers]
    if fleet:
        from service import fleet as fleet_mod

        plan = fleet_mod.plan(config)
        return [f"http://{_local(r.config.server.host)}:{r.port}" for r in plan.replicas]
    return [f"http://{_local(config.server.host)}:{config.server.port}"]


def settings(config: ServeConfig, fleet: bool = False) -> dict:
    """The learner's settings file, field for field its LearnSettings (dflash_models/learn/settings.py, which
    this package does not import): every default is the `learning:` section's."""
    lr = config.learning
    if not lr.enabled or lr.store_dir is None:
        raise ConfigError("learning.enabled: false: turn learning on (and restart the servers) before "
                          "`dflash-serve learn`; docs/LEARNING.md")
    work = lr.work_dir or lr.store_dir.parent / "learner"
    from service import launcher

    config, _ = launcher.resolve_models(config, download=False)  # the servers downloaded them
    if lr.dataset is not None and not lr.dataset.is_file():  # checked here: the servers never read it
        raise ConfigError(f"learning.dataset: {lr.dataset} is not a file (a JSONL of prompts or chats: "
                          f"docs/LEARNING.md)")
    if lr.dataset is None and not (Path(config.model.path) / "train_meta.json").is_file():
        raise ConfigError(f"learning.dataset: required for {config.model.path}: the original mix is the target's "
                          f"answers to prompts like its drafter's training data (a JSONL of prompts or chats, "
                          f"docs/LEARNING.md); the standard-library mix is only the bundled pair's")
    return {"target": str(config.model.path), "initial_drafter": str(config.speculative.draft_model_path),
            "store_dir": str(lr.store_dir), "work_dir": str(work), "servers": servers(config, fleet),
            "admin_key_env": config.server.admin_api_key_env, "threads": lr.threads, "steps": lr.steps,
            "device": lr.device, "dtype": lr.resolved_dtype(),
            "dataset": None if lr.dataset is None else str(lr.dataset),
            "original_share": lr.original_share, "min_sequences": lr.min_sequences,
            "holdout_fraction": lr.holdout_fraction, "promote_margin": lr.promote_margin,
            "promote_confidence": lr.promote_confidence,
            "max_original_loss": lr.max_original_loss, "interval_seconds": lr.interval_seconds,
            "metrics_port": lr.metrics_port}


def run(config: ServeConfig, action: str, fleet: bool = False) -> int:
    s = settings(config, fleet)
    work = Path(s["work_dir"])
    work.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = work / "settings.json"
    path.write_text(json.dumps(s, indent=1) + "\n")
    env = dict(os.environ, OMP_NUM_THREADS=str(s["threads"]))
    # exec, not a child: a signal to `dflash-serve learn` (SIGTERM from a supervisor) reaches the learner itself
    os.execve(sys.executable, [sys.executable, "-m", "dflash_models.learn", action, "--settings", str(path)], env)
