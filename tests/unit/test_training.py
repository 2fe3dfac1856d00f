"""Training code for the bundled pair: a few steps learn, the DFlash block layout and loss weights
are right, the training-time drafter computes what SGLang's DFlashDraftModel computes, and the
bundled artifacts load."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_models import drafter_model as dm
from dflash_models import train_drafter, train_target
from dflash_models.tiny import drafter_config, save_drafter

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "models" / "tiny-code"
VOCAB = 512


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def small_target_spec(**kw) -> train_target.TargetSpec:
    kw = {"steps": 20, **kw}
    return train_target.TargetSpec(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=4,
                                   num_heads=2, num_kv_heads=1, head_dim=32, seq_len=32, batch_size=4,
                                   warmup=2, lr=1e-2, **kw)


def small_target(spec: train_target.TargetSpec | None = None):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = train_target.target_config(spec or small_target_spec(), {"<|endoftext|>": 0, "<|im_end|>": 2})
    cfg._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(cfg)


@pytest.fixture(scope="module")
def saved_small_pair(tmp_path_factory):
    """A small random target (HF dir) and a random drafter for it (z-lab dir, bf16 like the bundle)."""
    d = tmp_path_factory.mktemp("pair")
    target = small_target().eval()
    target.save_pretrained(d / "target")
    tcfg = json.loads((d / "target" / "config.json").read_text())
    cfg = drafter_config(tcfg, num_layers=2, block_size=8, mask_token_id=3,
                         target_layer_ids=[1, 2])
    drafter = dm.DFlashDrafter(cfg)
    drafter.init_weights(seed=1, std=0.15)  # large enough that drafts depend on the context
    save_drafter(d / "drafter", cfg, {k: v.to(torch.bfloat16) for k, v in drafter.state_dict().items()})
    return d / "target", d / "drafter"


def test_z_lab_target_layer_rule():
    rule = train_drafter.default_target_layer_ids
    assert rule(36, 5) == [1, 9, 17, 25, 33]  # z-lab/Qwen3-8B-DFlash-b16
    assert rule(6, 2) == [1, 3]  # the bundled pair
    assert rule(8, 1) == [4]
    with pytest.raises(ValueError):
        rule(3, 2)


def test_position_weights_exclude_anchor_and_decay():
    w = dm.position_weights(16, gamma=7.0)
    assert w.shape == (16,)
    assert w[0] == 0.0 and w[1] == 1.0
    for k in range(1, 16):
        assert w[k].item() == pytest.approx(math.exp(-(k - 1) / 7.0))
    assert torch.all(w[2:] < w[1:-1])


def test_block_layout_mask_and_labels():
    cfg = {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
           "num_key_value_heads": 1, "head_dim": 4, "block_size": 4,
           "dflash_config": {"mask_token_id": 99, "target_layer_ids": [0]}}
    d = dm.DFlashDrafter(cfg)
    tokens = torch.arange(10, 20)[None]  # [1, S=10]
    anchors = torch.tensor([[2, 7]])
    ids, pos = d.block_inputs(tokens, anchors)
    assert ids.tolist() == [[12, 99, 99, 99, 17, 99, 99, 99]]
    assert pos.tolist() == [[2, 3, 4, 5, 7, 8, 9, 10]]
    mask = d.attention_mask(anchors, seq_len=10)
    assert mask.shape == (1, 8, 10 + 8)
    ctx, own = mask[0, :, :10], mask[0, :, 10:]
    # context: strictly before the anchor (the anchor's own target state is not known at inference)
    assert ctx[:4].sum(-1).tolist() == [2] * 4 and ctx[4:].sum(-1).tolist() == [7] * 4
    assert ctx[0, :2].all() and not ctx[0, 2:].any()
    # bidirectional inside a block, blocks never see each other
    assert own[:4, :4].all() and own[4:, 4:].all() and not own[:4, 4:].any() and not own[4:, :4].any()
    labels, valid = dm.block_labels(tokens, anchors, 4)
    assert labels.tolist() == [[[12, 13, 14, 15], [17, 18, 19, 19]]]
    assert valid.tolist() == [[[True] * 4, [True, True, True, False]]]  # position 10 is past the sequence


def test_loss_is_weighted_ce_on_positions_1_to_bs_minus_1():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 2, 4, 8, generator=g)
    head = torch.randn(VOCAB, 8, generator=g)
    labels = torch.randint(0, VOCAB, (1, 2, 4), generator=g)
    valid = torch.ones(1, 2, 4, dtype=torch.bool)
    valid[0, 1, 3] = False
    loss, _ = dm.dflash_loss(hidden, labels, valid, head, gamma=2.0)
    ce = torch.nn.functional.cross_entropy((hidden @ head.T).flatten(0, 2), labels.flatten(), reduction="none")
    w = (dm.position_weights(4, 2.0)[None, None] * valid).flatten()
    assert loss.item() == pytest.approx(((ce * w).sum() / w.sum()).item(), rel=1e-5)
    hidden2 = hidden.clone()
    hidden2[:, :, 0] += 5.0  # the anchor position carries no loss
    hidden2[0, 1, 3] -= 5.0  # nor does a position past the sequence
    assert dm.dflash_loss(hidden2, labels, valid, head, 2.0)[0].item() == pytest.approx(loss.item(), rel=1e-6)


def test_target_training_steps_reduce_loss():
    spec = small_target_spec(steps=12)
    model = small_target(spec)
    g = torch.Generator().manual_seed(0)
    motif = torch.randint(4, VOCAB, (24,), generator=g)
    stream = motif.repeat(200)  # learnable: a repeating sequence
    opt = torch.optim.AdamW(train_target.param_groups(model, spec.weight_decay), lr=spec.lr)
    losses = []
    for step in range(spec.steps):
        for group in opt.param_groups:
            group["lr"] = train_target.lr_at(step, spec)
        x = train_target.sample_batch(stream, spec.batch_size, spec.seq_len, g)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert sum(losses[-3:]) / 3 < 0.6 * sum(losses[:3]) / 3, losses


def test_lr_schedule_warms_up_then_anneals_by_steps_or_time():
    spec = small_target_spec()
    assert train_target.lr_at(0, spec) < train_target.lr_at(1, spec) <= spec.lr
    assert train_target.lr_at(spec.steps, spec) == pytest.approx(spec.lr * spec.min_lr_ratio)
    assert train_target.lr_at(3, spec, time_frac=1.0) == pytest.approx(spec.lr * spec.min_lr_ratio)


def test_drafter_training_steps_reduce_loss(saved_small_pair):
    target = train_drafter.load_target(saved_small_pair[0])
    cfg = json.loads((saved_small_pair[1] / "config.json").read_text())
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(4, VOCAB, (40,), generator=g).tolist() for _ in range(4)]
    feats = train_drafter.precompute_features(target, seqs, cfg["dflash_config"]["target_layer_ids"],
                                              log=lambda *_: None)
    import random

    items = [(s, 10, f) for s, f in zip(seqs, feats)]
    tokens, f, anchors, ends = train_drafter.make_batch(items, 4, cfg["block_size"], random.Random(0))
    assert anchors.shape == (4, 4) and bool((anchors >= 10).all()) and bool((anchors < 39).all())
    drafter = dm.DFlashDrafter(cfg)
    drafter.init_weights(0)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings().weight
    assert not embed.weight.requires_grad and not head.requires_grad  # shared and frozen
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    labels, valid = dm.block_labels(tokens, anchors, cfg["block_size"], ends)
    losses = []
    for _ in range(15):
        loss, _ = dm.dflash_loss(drafter(f, tokens, anchors, embed), labels, valid, head, 7.0)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses  # memorising one batch of random tokens
    assert embed.weight.grad is None and head.grad is None


@pytest.fixture(scope="module")
def sglang_checks(saved_small_pair) -> dict[str, dict]:
    """dflash_models/sglang_check.py on the small random pair and the bundled pair, in one subprocess
    (SGLang imports on CPU only with DFLASH_SERVE_CPU=1 set at interpreter start)."""
    pairs = {"small-random": saved_small_pair}
    if (BUNDLED / "drafter" / "model.safetensors").is_file():
        pairs["bundled"] = (BUNDLED / "target", BUNDLED / "drafter")
    env = {**os.environ, "DFLASH_SERVE_CPU": "1", "OMP_NUM_THREADS": "1"}
    args = [str(p) for pair in pairs.values() for p in pair]
    r = subprocess.run([sys.executable, "-m", "dflash_models.sglang_check", *args],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(line) for line in r.stdout.strip().splitlines() if line.startswith("{")]
    return dict(zip(pairs, lines))


@pytest.mark.parametrize("pair", ["small-random", "bundled"])
def test_training_forward_equals_sglang_draft_model(pair, sglang_checks):
    """The checkpoint goes through SGLang's own loader and DFlashDraftModel modules (see
    dflash_models/sglang_check.py) and gives the same hidden states, logits and greedy drafts as the
    multi-block training forward."""
    if pair not in sglang_checks:
        pytest.skip("bundled pair not built")
    r = sglang_checks[pair]
    assert r["hidden_max_abs_diff"] <= 1e-4 * max(1.0, r["hidden_max_abs"]), r
    assert r["logits_max_abs_diff"] <= 1e-3, r
    assert r["greedy_drafts_equal"], r


@pytest.mark.skipif(not (BUNDLED / "drafter" / "model.safetensors").is_file(), reason="bundled pair not built")
def test_bundled_pair_loads_and_fits():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from service.config import load_config
    from service.preflight import check

    size = sum(f.stat().st_size for f in BUNDLED.rglob("*") if f.is_file())
    assert size <= 30e6, f"bundle is {size / 1e6:.1f} MB"
    tok = AutoTokenizer.from_pretrained(str(BUNDLED / "target"))
    model = AutoModelForCausalLM.from_pretrained(str(BUNDLED / "target"), dtype=torch.float32).eval()
    text = tok.apply_chat_template([{"role": "user", "content": "def add(a, b):"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == ids.shape[1] + 4 or out[0, -1].item() == tok.eos_token_id
    dcfg = json.loads((BUNDLED / "drafter" / "config.json").read_text())
    assert dcfg["dflash_config"]["mask_token_id"] == tok.convert_tokens_to_ids("<|mask|>")
    assert dcfg["dflash_config"]["target_layer_ids"] == train_drafter.default_target_layer_ids(
        model.config.num_hidden_layers, dcfg["num_hidden_layers"])
    report = check(load_config(REPO / "deploy" / "configs" / "cpu.yaml"))  # the default config serves it
    assert report.block_size == dcfg["block_size"] == 16
