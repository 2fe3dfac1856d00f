"""`dflash-serve learn` (service/cli.py runs this module as its own process with the config's settings):

    python -m dflash_models.learn round    --settings FILE   # one round: distill, gate, swap if promoted
    python -m dflash_models.learn loop     --settings FILE   # a round every interval_seconds
    python -m dflash_models.learn rollback --settings FILE   # the servers serve the previous version again
    python -m dflash_models.learn status   --settings FILE

The settings file is JSON written by service/learn.py from the `learning:` section (settings.py LearnSettings;
paths resolved; the admin key stays in the environment variable it names). A round trains a candidate, measures
it against the serving drafter, decides (gate.py) and promotes it or keeps it for the next round. Every gate
decision is printed and logged to work_dir/decisions.jsonl with both figures.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_models.learn import gate, store, swap
from dflash_models.learn.distill import FinetuneSpec, finetune, load_drafter, save_drafter
from dflash_models.learn.settings import LearnSettings
from dflash_models.learn.versions import INITIAL, Versions

# The original-mix check needs a large enough slice to see a loss of a few per cent (32 missed one).
ORIGINAL_TRAIN, ORIGINAL_EVAL, ORIGINAL_MAX_NEW = 96, 128, 96
ORIGINAL_MAX_PROMPT = 192  # tokens: the end of a longer prompt


def log(msg: str) -> None:
    print(msg, flush=True)


@dataclass
class Trained:
    """A round's candidate and what it was trained and is gated on."""

    captured: int  # requests in the store
    serving: str  # the version serving now
    base: Any  # its drafter
    cfg: dict  # its config.json
    cand: Any  # the candidate drafter, trained
    start: dict  # where the candidate started from (_start)
    steps: int  # this round's training steps
    fit: dict  # finetune's report
    trained_on: int  # captured requests trained on
    trained_through: float  # capture time of the newest one
    held_items: list  # the gate's held-out recent traffic, features included
    held_classes: list[str]  # "greedy" / "sampled" per held-out request
    orig_eval: list  # the original mix's gate slice


class Learner:
    def __init__(self, s: LearnSettings) -> None:
        self.s = s
        self.versions = Versions(s.work_dir, s.initial_drafter)
        self.admin_key = os.environ.get(s.admin_key_env) if s.admin_key_env else None
        if s.admin_key_env and not self.admin_key:
            raise SystemExit(f"dflash-serve learn: environment variable {s.admin_key_env} "
                             f"(server.admin_api_key_env) is not set: the hot swap needs the admin key")
        from dflash_models.learn.metrics import LearnMetrics

        self.metrics = LearnMetrics(s.metrics_port)
        self.metrics.set_serving(self.versions.serving)
        self._pair = None
        self._original = None
        self._initial_original: float | None = None

    @property
    def pair(self):
        if self._pair is None:
            from dflash_models.learn.distill import Pair

            self._pair = Pair(self.s.target, device=self.s.device, dtype=self.s.dtype)
        return self._pair

    def original(self, layer_ids: list[int]):
        """(train items, eval items) of the original mix, features included (computed once per process): the
        target's answers to the operator's prompts (`learning.dataset`), or without one to the bundled pair's own
        standard-library prompts."""
        if self._original is None:
            from dflash_models.learn.distill import original_mix

            cache = Path(self.s.work_dir) / "original"
            prompts: tuple = (None, None)
            if self.s.dataset:
                from dflash_models.learn import dataset

                train, held = dataset.split(dataset.read(self.s.dataset), ORIGINAL_TRAIN, ORIGINAL_EVAL)
                cache = cache / dataset.digest(self.s.dataset)  # a changed file: the target answers anew
                prompts = (dataset.encode(train, self.pair.tokenizer, ORIGINAL_MAX_PROMPT),
                           dataset.encode(held, self.pair.tokenizer, ORIGINAL_MAX_PROMPT))
            tr = original_mix(self.pair, ORIGINAL_TRAIN, "train", 11, ORIGINAL_MAX_NEW, cache / "train.pt", log,
                              max_prompt_tokens=ORIGINAL_MAX_PROMPT, prompts=prompts[0])
            ev = original_mix(self.pair, ORIGINAL_EVAL, "heldout", 12, ORIGINAL_MAX_NEW, cache / "eval.pt", log,
                              max_prompt_tokens=ORIGINAL_MAX_PROMPT, prompts=prompts[1])
            self._original = (self.pair.items(*tr, layer_ids, log=lambda *_: None),
                              self.pair.items(*ev, layer_ids, log=lambda *_: None))
        return self._original

    def round(self) -> dict:
        """One round: train a candidate on the captured traffic, measure it and the serving drafter, decide, and
        promote (hot-swap) it when the gate says so."""
        captured = store.read(self.s.store_dir)
        self.metrics.captured.set(len(captured))
        if len(captured) < self.s.min_sequences:
            self.metrics.rounds.labels(outcome="waiting").inc()
            log(f"[learn] {len(captured)} captured requests, waiting for {self.s.min_sequences}")
            return {"outcome": "waiting", "captured": len(captured)}
        trained = self.train(captured)
        figures, recent_all = self.measure(trained)
        return self.promote(trained, figures, self.decide(figures, recent_all))

    def train(self, captured: list) -> Trained:
        """The round's candidate, fine-tuned on the captured traffic but its newest slice (the gate's)."""
        s = self.s
        train, held = store.split_recent(captured, s.holdout_fraction)
        # A round's cost must not grow with the store (the target's features are regenerated for every sequence
        # used): train on a sample the size of what its steps can draw, gate on the newest of the held-out slice.
        draws = s.steps * FinetuneSpec.batch_size
        if len(train) > draws:
            train = sorted(random.Random(len(captured)).sample(train, draws), key=lambda c: c.t)
        held = held[-gate.MAX_SEQUENCES:]
        serving = self.versions.serving
        base, cfg = load_drafter(self.versions.path(serving))
        layer_ids = list(cfg["dflash_config"]["target_layer_ids"])
        orig_train, orig_eval = self.original(layer_ids)
        train_items = self.pair.items([c.sequence for c in train], [len(c.prompt) for c in train], layer_ids,
                                      log=lambda *_: None)
        held_items = self.pair.items([c.sequence for c in held], [len(c.prompt) for c in held], layer_ids,
                                     log=lambda *_: None)
        held_classes = ["sampled" if c.sampled else "greedy" for c in held if len(c.output) >= 2]
        log(f"[learn] round on {len(train_items)} captured requests ({len(held_items)} held out), serving {serving}")
        cand, start = self._start(base, serving, held)
        spec = FinetuneSpec(steps=s.steps, original_share=s.original_share, seed=len(self.versions.decisions()))

        def on_step(step: int, loss: float, tokens: int) -> None:
            self.metrics.loss.set(loss)
            self.metrics.tokens.inc(tokens)
            self.metrics.progress.set(step / spec.steps)

        fit = finetune(cand, self.pair, train_items, orig_train, spec, on_step=on_step, log=log)
        return Trained(len(captured), serving, base, cfg, cand, start, spec.steps, fit, len(train_items),
                       train[-1].t if train else 0.0, held_items, held_classes, orig_eval)

    def measure(self, t: Trained) -> tuple[dict, dict]:
        """Tokens per step of the serving drafter and the candidate on the held-out recent traffic (per class) and
        on the original mix -> (figures for the decision log, each drafter's recent gate.Acceptance)."""
        e, h = self.pair.embed, self.pair.head_w
        if self._initial_original is None:  # the config's drafter on the original mix: the bound on forgetting
            first, _ = load_drafter(self.versions.path(INITIAL))
            self._initial_original = gate.measure(first, e, h, t.orig_eval)["all"].tokens_per_step
        figures, recent_all = {}, {}
        for name, model in (("serving", t.base), ("candidate", t.cand)):
            recent = gate.measure(model, e, h, t.held_items, t.held_classes)
            recent_all[name] = recent["all"]
            original = gate.measure(model, e, h, t.orig_eval)["all"]
            figures[name] = {"recent": {k: v.summary() for k, v in recent.items()}, "original": original.summary()}
            self.metrics.tps.labels(slice="recent", drafter=name).set(recent["all"].tokens_per_step)
            self.metrics.tps.labels(slice="original", drafter=name).set(original.tokens_per_step)
        return figures, recent_all

    def decide(self, figures: dict, recent_all: dict) -> gate.Decision:
        """The gate on the measured figures (gate.decide)."""
        s = self.s
        return gate.decide(figures["serving"]["recent"]["all"]["tokens_per_step"],
                           figures["candidate"]["recent"]["all"]["tokens_per_step"],
                           figures["serving"]["original"]["tokens_per_step"],
                           figures["candidate"]["original"]["tokens_per_step"],
                           s.promote_margin, s.max_original_loss,
                           better=gate.better_share(recent_all["serving"], recent_all["candidate"]),
                           confidence=s.promote_confidence, original_initial=self._initial_original)

    def promote(self, t: Trained, figures: dict, d: gate.Decision) -> dict:
        """Act on the decision: a promoted candidate saved as the next version and hot-swapped into every server;
        a refused one (or one whose swap failed) kept for the next round. Logged either way."""
        s = self.s
        total = t.start["steps_before"] + t.steps  # the candidate's training steps since it left `serving`
        record = {"serving": t.serving, "train": t.fit, "captured": t.captured, "start": t.start,
                  "total_steps": total, "trained_on": t.trained_on, "gated_on": len(t.held_items),
                  **d.record(), "original_initial": round(self._initial_original, 3), "figures": figures}
        if not d.promote:
            self._keep_candidate(t.cand, t.serving, t.trained_through, total)
        else:
            version = self.versions.next_version()
            save_drafter(t.cand, t.cfg, self.versions.path(version), Path(s.target))
            record["version"] = version
            try:
                record["swaps"] = swap.push_all(s.servers, self.versions.path(version), version, self.admin_key)
            except swap.SwapError as err:
                record.update(promote=False, reason=f"promoted by the gate, swap failed: {err}")
                self._keep_candidate(t.cand, t.serving, t.trained_through, total)
                self.versions.log_decision(record)
                self.metrics.rounds.labels(outcome="failed").inc()
                log(f"[learn] {version}: swap failed: {err}")
                return {"outcome": "failed", **record}
            self.versions.promote(version)
            self.versions.drop_candidate()
            self.metrics.set_serving(version)
        self.versions.log_decision(record)
        outcome = "promoted" if d.promote else "refused"
        self.metrics.rounds.labels(outcome=outcome).inc()
        log(f"[learn] {outcome.upper()} {record.get('version', 'candidate')}: {d.reason} "
            f"(recent {d.recent_serving:.3f} -> {d.recent_candidate:.3f}, original {d.original_serving:.3f} -> "
            f"{d.original_candidate:.3f} tokens/step)")
        return {"outcome": outcome, **record}

    def _start(self, base, serving: str, held: list) -> tuple[object, dict]:
        """The drafter this round trains: the last refused candidate when it may go on (versions.py says when),
        else a copy of the serving drafter; and what it started from, for the decision log."""
        import torch

        meta = self.versions.candidate_meta()
        weights = self.versions.candidate_dir / "weights.pt"
        why = None
        if meta is None or not weights.is_file():
            pass
        elif meta["base"] != serving:
            why = f"last candidate was trained from {meta['base']}, {serving} serves now"
        elif held and held[0].t <= meta["trained_through"]:
            why = "last candidate trained on part of this round's held-out slice (too little new traffic)"
        else:
            cand = copy.deepcopy(base)
            cand.load_state_dict(torch.load(weights, map_location="cpu"))
            log(f"[learn] continuing the last candidate ({meta['steps']} steps so far, from {serving})")
            return cand, {"from": "candidate", "steps_before": int(meta["steps"])}
        if why:
            log(f"[learn] {why}: starting from {serving}")
        return copy.deepcopy(base), {"from": serving, "steps_before": 0}

    def _keep_candidate(self, cand, serving: str, trained_through: float, steps: int) -> None:
        import torch

        self.versions.drop_candidate()  # first: a learner killed below leaves no meta pointing at torn weights
        d = self.versions.candidate_dir
        d.mkdir(parents=True, exist_ok=True)
        torch.save(cand.state_dict(), d / "weights.tmp")
        (d / "weights.tmp").replace(d / "weights.pt")
        self.versions.write_candidate_meta({"base": serving, "trained_through": trained_through, "steps": steps})

    def rollback(self) -> str:
        state = self.versions.state()
        if not state["history"]:
            raise SystemExit("dflash-serve learn rollback: nothing to roll back to (serving the config's drafter)")
        previous = state["history"][-1]
        swap.push_all(self.s.servers, self.versions.path(previous), previous, self.admin_key)
        self.versions.rollback()
        self.versions.drop_candidate()
        self.metrics.set_serving(previous)
        self.versions.log_decision({"rollback": True, "from": state["serving"], "to": previous})
        log(f"[learn] rolled back: {state['serving']} -> {previous} on {len(self.s.servers)} server(s)")
        return previous


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dflash-serve learn", description=__doc__.splitlines()[0])
    p.add_argument("action", choices=["round", "loop", "rollback", "status"])
    p.add_argument("--settings", required=True, help="JSON settings (written by `dflash-serve learn`)")
    a = p.parse_args(argv)
    s = LearnSettings.read(a.settings)
    from dflash_models.progress import single_thread

    if s.dataset and a.action in ("round", "loop"):
        from dflash_models.learn import dataset

        try:  # before the target is loaded: a bad file is refused at once, naming the field and the line
            dataset.read(s.dataset)
        except dataset.DatasetError as e:
            print(f"dflash-serve learn: error: {e}", file=sys.stderr)
            return 2

    if a.action == "status":
        v = Versions(s.work_dir, s.initial_drafter)
        print(json.dumps({"state": v.state(), "captured": len(store.read(s.store_dir)),
                          "decisions": v.decisions()[-5:]}, indent=1))
        return 0
    single_thread(s.threads)
    learner = Learner(s)
    if a.action == "rollback":
        learner.rollback()
        return 0
    while True:
        try:
            learner.round()
        except swap.SwapError as e:
            log(f"[learn] error: {e}")
            if a.action == "round":
                return 1
        if a.action == "round":
            return 0
        time.sleep(s.interval_seconds)


if __name__ == "__main__":
    sys.exit(main())
