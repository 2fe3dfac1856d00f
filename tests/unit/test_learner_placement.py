"""The learner where the operator puts it (docs/LEARNING.md): `learning.device` and `learning.dtype` reach the
learner's target and training, and the original mix is the target's answers to the operator's dataset (a JSONL of
prompts or chats), the standard-library mix only the bundled pair's default. On CPU: bfloat16 there runs the same
code path a GPU's bfloat16 does (target weights in bfloat16, the drafter's matmuls under autocast)."""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest

from dflash_models.learn import dataset
from service.config import ConfigError, parse_config
from tests.conftest import BUNDLED


def _config(tmp_path: Path, target: Path, **learning):
    return parse_config({
        "model": {"path": str(target)}, "server": {"admin_api_key_env": "ADMIN_K"},
        "speculative": {"algorithm": "dflash_adaptive", "draft_model_path": str(BUNDLED / "drafter")},
        "learning": {"enabled": True, "store_dir": str(tmp_path / "store"), **learning}}, base=tmp_path)


def test_device_dtype_and_dataset_reach_the_learners_settings(tmp_path):
    from service import learn

    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "a"}\n{"prompt": "b"}\n')
    s = learn.settings(_config(tmp_path, BUNDLED / "target", device="cuda:1", dataset="prompts.jsonl"))
    assert (s["device"], s["dtype"], s["dataset"]) == ("cuda:1", "bfloat16", str(data))  # auto: bf16 on a GPU
    s = learn.settings(_config(tmp_path, BUNDLED / "target"))
    assert (s["device"], s["dtype"], s["dataset"]) == ("cpu", "float32", None)  # the bundled pair: stdlib mix
    assert learn.settings(_config(tmp_path, BUNDLED / "target", dtype="bfloat16"))["dtype"] == "bfloat16"

    with pytest.raises(ConfigError, match=r"learning.device: 'gpu': expected cpu, cuda or cuda:N"):
        _config(tmp_path, BUNDLED / "target", device="gpu")
    with pytest.raises(ConfigError, match=r"learning.dataset: .*nope.jsonl is not a file"):
        learn.settings(_config(tmp_path, BUNDLED / "target", dataset="nope.jsonl"))
    other = tmp_path / "other-target"  # not the bundled pair: its standard-library mix is no original mix here
    other.mkdir()
    (other / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"learning.dataset: required for .*other-target"):
        learn.settings(_config(tmp_path, other))
    assert learn.settings(_config(tmp_path, other, dataset=str(data)))["dataset"] == str(data)


def test_the_dataset_reads_prompts_and_chats_and_names_a_bad_line(tmp_path):
    from transformers import AutoTokenizer

    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([
        json.dumps({"prompt": "def parse(line):"}), "",
        json.dumps({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                 {"role": "assistant", "content": "Hello!"}]}),
    ]) + "\n")
    rows = dataset.read(path)
    assert rows == [{"prompt": "def parse(line):"},  # a chat's trailing answer dropped: the target answers anew
                    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}]
    tok = AutoTokenizer.from_pretrained(str(BUNDLED / "target"))
    ids = dataset.encode(rows, tok, 192)
    assert ids[0] == tok("def parse(line):", add_special_tokens=False)["input_ids"]
    chat = tok.decode(ids[1])
    assert "Be brief." in chat and "Hi" in chat and "Hello!" not in chat
    assert chat.rstrip().endswith(tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False,
                                                          add_generation_prompt=True).rstrip()[-12:])
    train, held = dataset.split(list(range(10)), 96, 128)
    assert len(held) == 5 and sorted(train + held) == list(range(10))  # at most half held out, never in both

    for text, why in (('{"prompt": "a"}\nnot json\n', "line 2: not JSON"),
                      ('{"prompt": "a"}\n{"text": "b"}\n', "line 2: needs a non-empty prompt"),
                      ('{"prompt": "a"}\n{"messages": [{"role": "user"}]}\n', "line 2: messages: each needs"),
                      ('{"prompt": "a"}\n', "holds 1 request")):
        path.write_text(text)
        with pytest.raises(dataset.DatasetError, match=f"learning.dataset: {path} .*{why}"):
            dataset.read(path)


def test_a_round_in_bfloat16_on_the_operators_dataset(tmp_path, capsys):
    """A learning round with the target in bfloat16 and the original mix generated from the operator's prompts:
    the target's answers cached under the dataset's digest, the round decided, its candidate float32; a bad
    dataset line stops the learner before the target loads, naming field and line."""
    import torch
    from transformers import AutoTokenizer

    from dflash_models import corpus
    from dflash_models.learn import cli
    from dflash_models.learn.cli import Learner
    from dflash_models.learn.settings import LearnSettings
    from sglang_ext.capture import CaptureWriter
    from sglang_ext.settings import CaptureSettings

    tok = AutoTokenizer.from_pretrained(str(BUNDLED / "target"))
    files = corpus.split_files(corpus.stdlib_files()).heldout[:10]
    texts = [corpus.read_text(f)[:600] for f in files]
    data = tmp_path / "prompts.jsonl"
    chats = [{"messages": [{"role": "user", "content": t[:120]}]} for t in texts[4:6]]
    data.write_text("".join(json.dumps(row) + "\n" for row in [{"prompt": t[:200]} for t in texts[:4]] + chats))
    w = CaptureWriter(CaptureSettings(store_dir=str(tmp_path / "store")))
    for t in texts:
        ids = tok(t, add_special_tokens=False)["input_ids"][:80]
        w.offer(ids[:32], ids[32:], sampled=False)
        time.sleep(0.01)
    w.close()
    work = tmp_path / "learner"
    s = LearnSettings(work_dir=str(work), initial_drafter=str(BUNDLED / "drafter"), store_dir=str(tmp_path / "store"),
                      target=str(BUNDLED / "target"), min_sequences=8, holdout_fraction=0.25, steps=2,
                      original_share=0.25, promote_margin=10.0, promote_confidence=0.95, max_original_loss=0.05,
                      servers=[], admin_key_env=None, threads=1, interval_seconds=300.0, metrics_port=None,
                      device="cpu", dtype="bfloat16", dataset=str(data))
    learner = Learner(s)
    assert learner.pair.target.dtype == torch.bfloat16 and learner.pair.head_w.dtype == torch.bfloat16
    result = learner.round()
    assert result["outcome"] == "refused" and result["train"]["loss"] > 0
    cached = work / "original" / dataset.digest(data)
    answers = torch.load(cached / "train.pt")["sequences"] + torch.load(cached / "eval.pt")["sequences"]
    assert len(answers) == 6  # every prompt of the file, train and eval apart
    assert result["figures"]["candidate"]["original"]["steps"] > 0
    weights = torch.load(learner.versions.candidate_dir / "weights.pt")
    assert {v.dtype for v in weights.values()} == {torch.float32}  # trained in float32, matmuls under autocast

    data.write_text('{"prompt": "a"}\n{"prompt": ""}\n')
    settings = tmp_path / "settings.json"
    settings.write_text(json.dumps(dataclasses.asdict(s)))
    assert cli.main(["round", "--settings", str(settings)]) == 2
    assert f"learning.dataset: {data} line 2" in capsys.readouterr().err
