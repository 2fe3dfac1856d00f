"""Train the bundled DFlash drafter for a target on CPU (the paper's recipe).

    python -m dflash_models.train_drafter models/tiny-code/target models/tiny-code/drafter \
        --data /tmp/regen.pt [--steps 2400 --time-budget-min 40 --threads 2]

- data: the target's own greedy responses (`dflash_models.regen`); anchors are drawn at random
  inside each response, a block is the anchor token followed by B-1 mask tokens;
- context: the target's hidden states after `target_layer_ids` (z-lab's default rule) of the
  tokens strictly before the anchor, fused by `fc` + `hidden_norm` and injected as K/V into every
  drafter layer; attention is bidirectional inside the block;
- loss: cross-entropy on block positions 1..B-1 weighted exp(-(k-1)/gamma), normalised;
- the target's embedding and LM head are shared and frozen (the drafter checkpoint has neither).

Writes the z-lab checkpoint (config.json with dflash_config, model.safetensors in bf16) and
`train_meta.json`.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dflash_models.progress import Progress, fmt_secs, single_thread


@dataclass(frozen=True)
class DrafterSpec:
    num_layers: int = 2
    block_size: int = 16
    gamma: float = 7.0  # the paper's decay for block 16
    batch_size: int = 16  # sequences per step
    anchors: int = 16  # blocks per sequence
    steps: int = 2400  # ~28 min at 2 torch threads on a 2-core machine (0.7 s/step)
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup: int = 30
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    eval_sequences: int = 96  # regenerated sequences held out of training for the offline estimate
    seed: int = 0


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's rule (SGLang `build_target_layer_ids`): one target layer per draft layer, spread
    evenly from layer 1 to layer N-3; the middle layer for a 1-layer drafter."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end < start:
        raise ValueError(f"the DFlash layer rule needs a target of >= 4 layers, got {num_target_layers}")
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def load_target(target_dir: str | Path, dtype: str = "float32", device: str = "cpu"):
    """The frozen target, in `dtype` (a torch dtype's name) on `device`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=getattr(torch, dtype)).to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def target_features(target, input_ids, layer_ids: list[int], attention_mask=None):
    """Concatenated hidden states after each target layer in `layer_ids` ([B, S, K*H]): what
    SGLang captures for DFlash (the residual stream entering layer L+1)."""
    import torch

    captured: dict[int, torch.Tensor] = {}
    hooks = [target.model.layers[i].register_forward_hook(
        lambda _m, _inp, out, i=i: captured.__setitem__(i, out[0] if isinstance(out, tuple) else out))
        for i in layer_ids]
    try:
        with torch.no_grad():
            target.model(input_ids=input_ids, attention_mask=attention_mask)
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([captured[i] for i in layer_ids], dim=-1)


def precompute_features(target, sequences: list[list[int]], layer_ids: list[int], batch: int = 32, log=print):
    """Per-sequence feature tensors (stored bf16, in host memory: a GPU target's would not fit there), right-padded
    batches of similar length."""
    import torch

    device = next(target.parameters()).device

    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    feats: list = [None] * len(sequences)
    prog = Progress("features", (len(order) + batch - 1) // batch, every=10)
    for b in range(0, len(order), batch):
        idx = order[b:b + batch]
        width = max(len(sequences[i]) for i in idx)
        x = torch.zeros(len(idx), width, dtype=torch.long)
        for r, i in enumerate(idx):
            x[r, :len(sequences[i])] = torch.tensor(sequences[i])
        f = target_features(target, x.to(device), layer_ids)  # right padding: causal, earlier tokens unaffected
        for r, i in enumerate(idx):
            feats[i] = f[r, :len(sequences[i])].to("cpu", torch.bfloat16)  # half the memory; batches are fp32
        prog.update(b // batch + 1, tokens=sum(len(sequences[i]) for i in idx))
    return feats


def make_batch(items: list[tuple[list[int], int, "object"]], n_anchors: int, block_size: int, rng: random.Random):
    """Right-padded tokens/features, anchors [B, N] inside each response and valid ends [B]."""
    import torch

    width = max(len(s) for s, _, _ in items)
    kh = items[0][2].shape[-1]
    tokens = torch.zeros(len(items), width, dtype=torch.long)
    feats = torch.zeros(len(items), width, kh)
    anchors = torch.zeros(len(items), n_anchors, dtype=torch.long)
    ends = torch.zeros(len(items), dtype=torch.long)
    for r, (seq, start, f) in enumerate(items):
        tokens[r, :len(seq)] = torch.tensor(seq)
        feats[r, :len(seq)] = f
        ends[r] = len(seq)
        cand = list(range(start, len(seq) - 1))  # at least one label after the anchor
        pick = rng.sample(cand, n_anchors) if len(cand) >= n_anchors else [rng.choice(cand) for _ in range(n_anchors)]
        anchors[r] = torch.tensor(sorted(pick))
    return tokens, feats, anchors, ends


def lr_at(step: int, spec: DrafterSpec, time_frac: float = 0.0) -> float:
    """Warmup, then cosine; progress = max(step fraction, elapsed / time budget)."""
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    t = min(1.0, max((step - spec.warmup) / max(1, spec.steps - spec.warmup), time_frac))
    return spec.lr * (spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def evaluate(drafter, embed, head_w, items, spec: DrafterSpec, seed: int = 123) -> dict:
    """Loss and the greedy accepted length per block (1 + leading correct drafts) on held-out items."""
    import torch

    from dflash_models.drafter_model import block_labels, dflash_loss

    rng = random.Random(seed)
    losses, taus, acc1 = [], [], []
    if not items:
        return {"loss": float("nan"), "tau": float("nan"), "acc1": float("nan")}
    with torch.no_grad():
        for b in range(0, len(items), spec.batch_size):
            tokens, feats, anchors, ends = make_batch(items[b:b + spec.batch_size], spec.anchors, spec.block_size, rng)
            hidden = drafter(feats, tokens, anchors, embed)
            labels, valid = block_labels(tokens, anchors, spec.block_size, ends)
            loss, st = dflash_loss(hidden, labels, valid, head_w, spec.gamma)
            losses.append(loss.item()); taus.append(st["tau"]); acc1.append(st["acc1"])
    return {"loss": sum(losses) / len(losses), "tau": sum(taus) / len(taus), "acc1": sum(acc1) / len(acc1)}


def train(target_dir: str | Path, out_dir: str | Path, regen: dict, spec: DrafterSpec = DrafterSpec(),
          time_budget_s: float | None = None, log=print) -> dict:
    import torch

    from dflash_models.drafter_model import DFlashDrafter, block_labels, dflash_loss
    from dflash_models.tiny import drafter_config, save_drafter
    from dflash_models.tokenizer import special_ids
    from transformers import AutoTokenizer

    t_start = time.perf_counter()
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    target = load_target(target_dir)
    tcfg = json.loads((target_dir / "config.json").read_text())
    ids = special_ids(AutoTokenizer.from_pretrained(str(target_dir)))
    layer_ids = default_target_layer_ids(tcfg["num_hidden_layers"], spec.num_layers)
    cfg = drafter_config(tcfg, num_layers=spec.num_layers, block_size=spec.block_size,
                         target_layer_ids=layer_ids, mask_token_id=ids["<|mask|>"])
    log(f"[drafter] target {tcfg['num_hidden_layers']} layers -> target_layer_ids {layer_ids}; "
        f"{spec.num_layers} draft layers, block {spec.block_size}, gamma {spec.gamma}")

    seqs, starts = regen["sequences"], regen["response_start"]
    keep = [i for i in range(len(seqs)) if len(seqs[i]) - starts[i] >= 2]
    random.Random(spec.seed).shuffle(keep)
    feats = precompute_features(target, [seqs[i] for i in keep], layer_ids, log=log)
    items = [(seqs[i], starts[i], f) for i, f in zip(keep, feats)]
    n_held = min(spec.eval_sequences, len(items) // 5)
    held, train_items = items[:n_held], items[n_held:]
    log(f"[drafter] {len(train_items)} training sequences, {len(held)} held out; "
        f"{sum(len(s) - st for s, st, _ in train_items):,} response tokens "
        f"({fmt_secs(time.perf_counter() - t_start)} for features)")

    torch.manual_seed(spec.seed)
    drafter = DFlashDrafter(cfg)
    drafter.init_weights(spec.seed)
    embed = target.get_input_embeddings()
    head_w = target.get_output_embeddings().weight  # frozen, shared with the target
    n_params = sum(p.numel() for p in drafter.parameters())
    decay = [p for n, p in drafter.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in drafter.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": spec.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=spec.lr, betas=(0.9, 0.95))
    rng = random.Random(spec.seed)
    prog = Progress("drafter", spec.steps, every=10)
    ema: dict[str, float] = {}
    curve, stopped_at, order, cursor = [], None, list(range(len(train_items))), len(train_items)
    t_train = time.perf_counter()
    for step in range(1, spec.steps + 1):
        if cursor + spec.batch_size > len(order):
            rng.shuffle(order)
            cursor = 0
        batch = [train_items[i] for i in order[cursor:cursor + spec.batch_size]]
        cursor += spec.batch_size
        time_frac = 0.0 if time_budget_s is None else (time.perf_counter() - t_train) / time_budget_s
        for g in opt.param_groups:
            g["lr"] = lr_at(step - 1, spec, time_frac)
        tokens, f, anchors, ends = make_batch(batch, spec.anchors, spec.block_size, rng)
        hidden = drafter(f, tokens, anchors, embed)
        labels, valid = block_labels(tokens, anchors, spec.block_size, ends)
        loss, st = dflash_loss(hidden, labels, valid, head_w, spec.gamma)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), spec.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        for k, v in (("loss", loss.item()), ("acc1", st["acc1"]), ("tau", st["tau"])):
            ema[k] = v if k not in ema else 0.95 * ema[k] + 0.05 * v
        if step % 10 == 0:
            curve.append((step, round(ema["loss"], 4), round(ema["tau"], 3)))
        prog.update(step, tokens=anchors.numel() * spec.block_size, loss=ema["loss"], acc1=ema["acc1"],
                    tau=ema["tau"], lr=opt.param_groups[0]["lr"])
        if time_frac >= 1.0 and step < spec.steps:
            stopped_at = step
            log(f"[drafter] time budget reached: stopping at step {step}/{spec.steps}")
            break
    train_s = time.perf_counter() - t_train
    drafter.eval()
    ev = evaluate(drafter, embed, head_w, held, spec)
    log(f"[drafter] held-out: loss {ev['loss']:.4f}, first-draft accuracy {ev['acc1']:.3f}, "
        f"offline acceptance length {ev['tau']:.2f}; training {fmt_secs(train_s)}")

    sd = {k: v.detach().to(torch.bfloat16) for k, v in drafter.state_dict().items()}
    save_drafter(out_dir, cfg, sd, tokenizer_dir=target_dir)
    meta = {"spec": asdict(spec), "params": n_params, "target_layer_ids": layer_ids,
            "train_sequences": len(train_items), "heldout_sequences": len(held),
            "steps_done": stopped_at or spec.steps, "train_seconds": round(train_s, 1),
            "total_seconds": round(time.perf_counter() - t_start, 1), "heldout": {k: round(v, 4) for k, v in ev.items()},
            "loss_curve": curve, "regen_seconds": round(float(regen.get("seconds", 0.0)), 1),
            "regen_sequences": len(seqs), "regen_max_new": regen.get("max_new"),
            "torch_threads": torch.get_num_threads()}
    (out_dir / "train_meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    log(f"[drafter] saved -> {out_dir} ({fmt_secs(time.perf_counter() - t_start)} in all)")
    return meta


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("target_dir")
    p.add_argument("out_dir")
    p.add_argument("--data", required=True, help="regenerated responses (python -m dflash_models.regen)")
    p.add_argument("--steps", type=int, default=DrafterSpec.steps)
    p.add_argument("--layers", type=int, default=DrafterSpec.num_layers)
    p.add_argument("--block-size", type=int, default=DrafterSpec.block_size)
    p.add_argument("--gamma", type=float, default=DrafterSpec.gamma)
    p.add_argument("--batch-size", type=int, default=DrafterSpec.batch_size)
    p.add_argument("--anchors", type=int, default=DrafterSpec.anchors)
    p.add_argument("--lr", type=float, default=DrafterSpec.lr)
    p.add_argument("--seed", type=int, default=DrafterSpec.seed)
    p.add_argument("--time-budget-min", type=float, default=None)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    single_thread(a.threads)
    import torch

    spec = DrafterSpec(num_layers=a.layers, block_size=a.block_size, gamma=a.gamma, batch_size=a.batch_size,
                       anchors=a.anchors, steps=a.steps, lr=a.lr, seed=a.seed)
    train(a.target_dir, a.out_dir, torch.load(a.data), spec,
          None if a.time_budget_min is None else 60 * a.time_budget_min)


if __name__ == "__main__":
    main()
