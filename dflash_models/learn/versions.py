"""The learner's drafter versions and what each server should serve (work_dir layout):

    work_dir/drafters/v0001/        a promoted or candidate drafter (z-lab checkpoint: config.json, model.safetensors)
    work_dir/state.json             {"serving": version or "initial", "history": [versions served before, oldest first]}
    work_dir/decisions.jsonl        every gate decision with both figures
    work_dir/candidate/             the last refused candidate (float32 weights, meta.json): the next round goes on
                                    training it instead of starting over from the serving drafter

"initial" is the config's own drafter (`speculative.draft_model_path`), which the servers load at start.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

INITIAL = "initial"


class Versions:
    def __init__(self, work_dir: str | Path, initial_drafter: str | Path) -> None:
        self.dir = Path(work_dir)
        self.initial = Path(initial_drafter)
        (self.dir / "drafters").mkdir(parents=True, exist_ok=True)

    @property
    def state_path(self) -> Path:
        return self.dir / "state.json"

    def state(self) -> dict:
        if self.state_path.is_file():
            return json.loads(self.state_path.read_text())
        return {"serving": INITIAL, "history": []}

    def _write_state(self, state: dict) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1) + "\n")
        tmp.replace(self.state_path)  # atomic: a learner killed mid-write leaves the previous state

    @property
    def serving(self) -> str:
        return self.state()["serving"]

    def path(self, version: str) -> Path:
        return self.initial if version == INITIAL else self.dir / "drafters" / version

    def next_version(self) -> str:
        done = [p.name for p in (self.dir / "drafters").glob("v*") if p.name[1:].isdigit()]
        return f"v{max([int(n[1:]) for n in done], default=0) + 1:04d}"

    def promote(self, version: str) -> None:
        s = self.state()
        s["history"].append(s["serving"])
        s["serving"] = version
        self._write_state(s)

    def rollback(self) -> str:
        """Make the version served before the current one serving again; returns it."""
        s = self.state()
        if not s["history"]:
            raise RuntimeError("nothing to roll back to: the servers run the config's own drafter (initial)")
        s["serving"] = s["history"].pop()
        self._write_state(s)
        return s["serving"]

    def log_decision(self, record: dict) -> None:
        with open(self.dir / "decisions.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps({"time": round(time.time(), 1), **record}) + "\n")

    def decisions(self) -> list[dict]:
        p = self.dir / "decisions.jsonl"
        return [json.loads(x) for x in p.read_text().splitlines()] if p.is_file() else []

    # A refused candidate is where training stands, not a dead end: the next round continues it, so training time
    # adds up across rounds (a round's steps alone are minutes of CPU). It is only continued while the drafter it
    # started from is still serving (a promotion or rollback ends the line) and while the gate's held-out slice is
    # newer than everything it trained on (`trained_through`), so the gate never scores it on its own training data.
    @property
    def candidate_dir(self) -> Path:
        return self.dir / "candidate"

    def candidate_meta(self) -> dict | None:
        p = self.candidate_dir / "meta.json"
        return json.loads(p.read_text()) if p.is_file() else None

    def write_candidate_meta(self, meta: dict) -> None:
        tmp = self.candidate_dir / "meta.tmp"
        tmp.write_text(json.dumps(meta) + "\n")
        tmp.replace(self.candidate_dir / "meta.json")

    def drop_candidate(self) -> None:
        (self.candidate_dir / "meta.json").unlink(missing_ok=True)  # the weights without it are never read
