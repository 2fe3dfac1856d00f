"""The learning drafter without a server: the capture store's limits and its non-blocking handover, the
`learning:` config, the gate's rule, and the gate refusing a randomly perturbed drafter measured on the bundled
pair (offline, as `dflash-serve learn` measures)."""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import pytest

from dflash_models.learn import gate, store
from dflash_models.learn.versions import INITIAL, Versions
from service.config import ConfigError, parse_config
from sglang_ext import names
from sglang_ext.capture import CaptureWriter, prune, segments
from sglang_ext.settings import CaptureSettings
from tests.conftest import BUNDLED


def _writer(tmp_path: Path, **kw) -> CaptureWriter:
    return CaptureWriter(CaptureSettings(store_dir=str(tmp_path / "store"), **kw))


def test_the_store_keeps_token_ids_only_and_the_reader_reads_them(tmp_path):
    w = _writer(tmp_path)
    w.offer([5, 6, 7], [8, 9], sampled=False)
    w.offer([1] * 300, [2, 3, 4], sampled=True)
    w.close()
    got = store.read(tmp_path / "store")
    assert [(c.prompt, c.output, c.sampled) for c in got] == [([5, 6, 7], [8, 9], False), ([1] * 192, [2, 3, 4], True)]
    line = json.loads(segments(tmp_path / "store")[0].read_text().splitlines()[0])
    assert set(line) == {"t", "p", "o", "s"}


def test_the_store_stays_within_its_size_limit(tmp_path):
    w = _writer(tmp_path, max_store_bytes=20_000, segment_bytes=4_000)
    for i in range(400):
        w.offer(list(range(20)), list(range(i, i + 20)), sampled=False)
    w.close()
    total = sum(p.stat().st_size for p in segments(tmp_path / "store"))
    assert 0 < total <= 20_000 + 4_000  # the open segment may run one line past a prune
    kept = store.read(tmp_path / "store")
    assert kept and kept[-1].output == list(range(399, 419)), "the newest requests are the ones kept"


def test_segments_past_the_age_limit_are_deleted(tmp_path):
    d = tmp_path / "store"
    d.mkdir()
    old, new = d / "seg-00000000000000000001.jsonl", d / "seg-00000000000000000002.jsonl"
    old.write_text('{"t":1,"p":[1],"o":[2,3],"s":false}\n')
    new.write_text('{"t":2,"p":[1],"o":[2,3],"s":false}\n')
    past = time.time() - 3 * 3600
    os.utime(old, (past, past))
    assert prune(d, max_bytes=10**9, max_age_s=3600) == 1
    assert segments(d) == [new]


class _SlowDisk(CaptureWriter):
    def _write(self, item) -> None:
        time.sleep(0.2)
        super()._write(item)


def test_a_full_queue_drops_requests_instead_of_blocking_the_scheduler(tmp_path):
    w = _SlowDisk(CaptureSettings(store_dir=str(tmp_path / "store"), queue_max=2))
    t0 = time.perf_counter()
    accepted = [w.offer([1], [2, 3], sampled=False) for _ in range(50)]
    assert time.perf_counter() - t0 < 0.1
    assert accepted.count(False) == w.dropped >= 45
    w.close(timeout=10)


def _cfg(**learning) -> dict:
    return {"model": {"path": "m"}, "server": {"admin_api_key_env": "ADMIN_K"},
            "speculative": {"algorithm": "dflash_adaptive", "draft_model_path": "d"}, "learning": learning}


def test_learning_is_off_by_default_and_its_section_is_checked(tmp_path):
    from service.launcher import server_env

    off = parse_config({"model": {"path": "m"}, "speculative": {"algorithm": "dflash", "draft_model_path": "d"}})
    assert not off.learning.enabled and names.CAPTURE not in server_env(off, base={})
    on = parse_config(_cfg(enabled=True, store_dir="st", max_store_mb=8, max_age_hours=2), base=tmp_path)
    s = CaptureSettings.from_env(server_env(on, base={}))
    assert s.store_dir == str(tmp_path / "st") and s.max_store_bytes == 8 * 1024 * 1024 and s.max_age_seconds == 7200
    with pytest.raises(ConfigError, match="learning: store_dir"):
        parse_config(_cfg(enabled=True))
    with pytest.raises(ConfigError, match="admin_api_key_env"):
        parse_config({**_cfg(enabled=True, store_dir="s"), "server": {}})
    with pytest.raises(ConfigError, match="DFlash drafter"):
        parse_config({**_cfg(enabled=True, store_dir="s"), "speculative": {"algorithm": "none"}})


def test_the_learner_reads_every_setting_the_config_writes_and_no_other(tmp_path):
    """service/learn.py writes the settings from the `learning:` section (every default is the config's);
    the learner's LearnSettings reads exactly those fields and refuses a file with others or fewer."""
    from dflash_models.learn.settings import LearnSettings
    from service import learn

    (tmp_path / "prompts.jsonl").write_text('{"prompt": "a"}\n')  # the original mix of a target not bundled
    cfg = parse_config(_cfg(enabled=True, store_dir="st", dataset="prompts.jsonl"), base=tmp_path)
    written = learn.settings(cfg)
    assert set(written) == {f.name for f in dataclasses.fields(LearnSettings)}
    path = tmp_path / "settings.json"
    path.write_text(json.dumps(written))
    s = LearnSettings.read(path)
    assert s.steps == cfg.learning.steps and s.promote_confidence == cfg.learning.promote_confidence
    path.write_text(json.dumps({k: v for k, v in written.items() if k != "threads"}))
    with pytest.raises(SystemExit, match=r"missing \['threads'\]"):
        LearnSettings.read(path)


def test_the_gate_rule_needs_both_figures():
    assert gate.decide(2.0, 2.2, 6.0, 5.9, margin=0.05, max_original_loss=0.05).promote
    no_gain = gate.decide(2.0, 2.05, 6.0, 6.0, margin=0.05, max_original_loss=0.05)
    assert not no_gain.promote and "recent traffic" in no_gain.reason
    forgot = gate.decide(2.0, 3.0, 6.0, 5.0, margin=0.05, max_original_loss=0.05)
    assert not forgot.promote and "original mix" in forgot.reason
    assert forgot.record()["recent"] == {"serving": 2.0, "candidate": 3.0}


def test_the_gate_refuses_a_gain_that_one_lucky_sequence_makes():
    """+10 % on the slice, all of it from one sequence of twenty: the resamples without that sequence show no gain,
    so it is refused; the same +10 % spread over every sequence is promoted."""
    serving = gate.Acceptance(per_sequence=[(40, 10)] * 20)
    lucky = gate.Acceptance(per_sequence=[(40, 10)] * 19 + [(120, 10)])
    spread = gate.Acceptance(per_sequence=[(44, 10)] * 20)
    for cand in (lucky, spread):
        cand.tokens, cand.steps = sum(t for t, _ in cand.per_sequence), sum(n for _, n in cand.per_sequence)
    serving.tokens, serving.steps = 800, 200
    assert lucky.tokens_per_step == spread.tokens_per_step == 4.4
    share = gate.better_share(serving, lucky)
    assert 0.5 < share < 0.95  # the lucky sequence is in ~64 % of resamples
    refused = gate.decide(4.0, 4.4, 6.0, 6.0, margin=0.05, max_original_loss=0.05, better=share)
    assert not refused.promote and "resamples" in refused.reason
    promoted = gate.decide(4.0, 4.4, 6.0, 6.0, margin=0.05, max_original_loss=0.05,
                           better=gate.better_share(serving, spread))
    assert promoted.promote
    assert gate.better_share(serving, serving) == 0.0  # a tie is no gain


def test_the_original_mix_bound_is_against_the_first_drafter_so_losses_do_not_add_up():
    """A second promotion losing 4 % against the serving drafter, which had itself lost 4 %: 7.9 % in all against
    the config's drafter, past the 5 % bound. In the live run that led here, the drafter read 16 % lower on the
    original mix after two promotions, each within 5 % of the one before."""
    second = gate.decide(9.0, 10.0, 6.72, 6.45, margin=0.05, max_original_loss=0.05)
    assert second.promote  # against the serving drafter alone: -4.0 %
    bounded = gate.decide(9.0, 10.0, 6.72, 6.45, margin=0.05, max_original_loss=0.05, original_initial=7.0)
    assert not bounded.promote and "config's drafter" in bounded.reason and "-7.9%" in bounded.reason


def test_versions_promote_and_roll_back(tmp_path):
    v = Versions(tmp_path, tmp_path / "initial-drafter")
    assert v.serving == INITIAL and v.path(INITIAL) == tmp_path / "initial-drafter"
    assert v.next_version() == "v0001"
    v.promote("v0001")
    assert v.rollback() == INITIAL and v.serving == INITIAL
    with pytest.raises(RuntimeError, match="nothing to roll back"):
        v.rollback()


@pytest.mark.skipif(not (BUNDLED / "drafter" / "model.safetensors").is_file(), reason="needs models/tiny-code")
def test_the_gate_refuses_a_randomly_perturbed_drafter(tmp_path):
    """On the target's own greedy responses to prompts of the held-out stdlib files (the learner's original mix),
    measured as `dflash-serve learn` measures."""
    import copy

    import torch

    from dflash_models.learn.distill import Pair, load_drafter, original_mix

    pair = Pair(BUNDLED / "target")
    serving, cfg = load_drafter(BUNDLED / "drafter")
    seqs, starts = original_mix(pair, 12, "heldout", 12, 64, tmp_path / "eval.pt", log=lambda *_: None)
    items = pair.items(seqs, starts, cfg["dflash_config"]["target_layer_ids"], log=lambda *_: None)
    worse = copy.deepcopy(serving)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in worse.parameters():
            p.add_(0.3 * p.std() * torch.randn(p.shape, generator=g))
    a = gate.measure(serving, pair.embed, pair.head_w, items)["all"]
    b = gate.measure(worse, pair.embed, pair.head_w, items)["all"]
    assert a.tokens_per_step > 3.0 and b.tokens_per_step < a.tokens_per_step, (a, b)
    assert [n for _, n in a.per_sequence] and sum(t for t, _ in a.per_sequence) == a.tokens
    assert gate.better_share(serving=b, candidate=a) > 0.95 > gate.better_share(serving=a, candidate=b)
    d = gate.decide(a.tokens_per_step, b.tokens_per_step, a.tokens_per_step, b.tokens_per_step,
                    margin=0.05, max_original_loss=0.05)
    assert not d.promote
    assert gate.decide(a.tokens_per_step, a.tokens_per_step, a.tokens_per_step, a.tokens_per_step,
                       margin=0.05, max_original_loss=0.05).promote is False  # the same drafter gains nothing


def test_a_drafter_swap_keeps_the_old_acceptance_only_as_a_light_prior():
    """After drafter_changed the old drafter's curve is where the widths start (a promoted drafter is the old one
    fine-tuned), but worth only SWAPPED_PRIOR_STEPS observations: the new drafter's own acceptance outweighs it
    within a few steps, where the old counts would have held the estimate for hundreds. The cost table stays."""
    import numpy as np

    from sglang_ext.controller.config import ControllerConfig
    from sglang_ext.controller.cost_model import CostModel
    from sglang_ext.controller.policy import SWAPPED_PRIOR_STEPS, BlockSizeController

    def controller():
        cfg = ControllerConfig()
        return BlockSizeController(cfg, CostModel.default(cfg.candidates_for(16)), max_block=16)

    def observe(c, accepted: int, steps: int) -> None:
        for _ in range(steps):
            c.observe_step(["a", "b"], 16, np.array([accepted, accepted]), None, [[7] * (accepted + 1)] * 2)

    fresh, swapped, kept = controller(), controller(), controller()
    for c in (swapped, kept):
        observe(c, 15, 50)  # the old drafter: every draft accepted
    table = swapped.cost_model.table.copy()
    swapped.drafter_changed()
    assert SWAPPED_PRIOR_STEPS <= 16
    p = swapped.acceptance_probabilities()
    assert p[0] > 0.8 > fresh.acceptance_probabilities()[0]  # still the old drafter's, not the flat prior's
    np.testing.assert_array_equal(swapped.cost_model.table, table)
    for c in (swapped, kept):
        observe(c, 0, 8)  # the new drafter: nothing accepted
    assert swapped.acceptance_probabilities()[0] < 0.5 < kept.acceptance_probabilities()[0]


def test_the_learner_exposes_its_progress_on_its_own_registry():
    from prometheus_client import generate_latest

    from dflash_models.learn.metrics import LearnMetrics

    m = LearnMetrics(port=None)
    m.rounds.labels(outcome="refused").inc()
    m.loss.set(0.7)
    m.tokens.inc(4096)
    m.set_serving("v0001")
    m.set_serving("v0002")
    text = generate_latest(m.registry).decode()
    for line in ('dflash_learn_rounds_total{outcome="refused"} 1.0', "dflash_learn_loss 0.7",
                 "dflash_learn_tokens_seen_total 4096.0", 'dflash_learn_serving_info{drafter_version="v0001"} 0.0',
                 'dflash_learn_serving_info{drafter_version="v0002"} 1.0'):
        assert line in text, line


@pytest.mark.skipif(not (BUNDLED / "drafter" / "model.safetensors").is_file(), reason="needs models/tiny-code")
def test_a_refused_candidate_trains_on_next_round_and_is_never_gated_on_its_own_data(tmp_path):
    """Training adds up across rounds (a refused candidate is continued, not thrown away) only while the gate's
    held-out slice is traffic the candidate never trained on, and a promotion ends the line."""
    import torch
    from transformers import AutoTokenizer

    from dflash_models import corpus
    from dflash_models.learn.cli import Learner
    from dflash_models.learn.settings import LearnSettings
    from dflash_models.learn.distill import load_drafter

    tok = AutoTokenizer.from_pretrained(str(BUNDLED / "target"))
    files = corpus.split_files(corpus.stdlib_files()).heldout[:16]
    seqs = [tok(corpus.read_text(f)[:900], add_special_tokens=False)["input_ids"][:96] for f in files]
    w = _writer(tmp_path)

    def capture(batch):
        for s in batch:
            w.offer(s[:32], s[32:], sampled=False)
            time.sleep(0.01)  # distinct capture times: the held-out boundary is a time

    work = tmp_path / "learner"
    (work / "original").mkdir(parents=True)
    orig = {"sequences": seqs[:6], "starts": [32] * 6}  # a small original mix: no generation in a unit test
    torch.save(orig, work / "original" / "train.pt")
    torch.save(orig, work / "original" / "eval.pt")
    s = LearnSettings(work_dir=str(work), initial_drafter=str(BUNDLED / "drafter"), store_dir=str(tmp_path / "store"),
                      target=str(BUNDLED / "target"), min_sequences=8, holdout_fraction=0.25, steps=2,
                      original_share=0.25, promote_margin=10.0, promote_confidence=0.95, max_original_loss=0.05,
                      servers=[], admin_key_env=None, threads=1, interval_seconds=300.0, metrics_port=None,
                      device="cpu", dtype="float32", dataset=None)
    capture(seqs[:8])
    w.close()
    learner = Learner(s)
    first = learner.round()
    assert first["outcome"] == "refused" and first["start"] == {"from": "initial", "steps_before": 0}
    meta = learner.versions.candidate_meta()
    assert meta["base"] == "initial" and meta["steps"] == 2
    assert meta["trained_through"] < store.read(s.store_dir)[-2].t  # trained on 6, the newest 2 held out

    # The candidate's weights are what the next round trains: spoil them, and the next candidate is spoilt.
    spoilt, _ = load_drafter(BUNDLED / "drafter")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in spoilt.parameters():
            p.add_(2.0 * p.std() * torch.randn(p.shape, generator=g))  # ~1 token a step
    torch.save(spoilt.state_dict(), learner.versions.candidate_dir / "weights.pt")
    w = _writer(tmp_path)
    capture(seqs[8:])
    w.close()
    second = learner.round()
    assert second["start"] == {"from": "candidate", "steps_before": 2} and second["total_steps"] == 4
    gain = {k: v - 1.0 for k, v in second["recent"].items()}  # tokens a step beyond the target's own
    assert gain["candidate"] < 0.5 * gain["serving"], second["recent"]

    # A held-out slice reaching into what the candidate trained on: start over from the serving drafter.
    learner.s = dataclasses.replace(learner.s, holdout_fraction=0.5)
    third = learner.round()
    assert third["start"] == {"from": "initial", "steps_before": 0}

    # A promotion ends the line: the candidate is dropped, the next round starts from the promoted drafter.
    learner.s = dataclasses.replace(learner.s, promote_margin=-1.0, max_original_loss=10.0, promote_confidence=0.0)
    promoted = learner.round()
    assert promoted["outcome"] == "promoted" and learner.versions.serving == promoted["version"]
    assert learner.versions.candidate_meta() is None
