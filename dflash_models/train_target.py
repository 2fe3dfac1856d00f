"""Train the bundled target: a small Qwen3 causal LM on the stdlib corpus, on one CPU thread.

    python -m dflash_models.train_target models/tiny-code/target [--steps 900] [--time-budget-min 45]

Writes a Hugging Face model directory (bf16 safetensors, tokenizer, chat template) and
`train_meta.json` with the losses and timings the model card reports.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dflash_models import corpus, data
from dflash_models.progress import Progress, fmt_secs, single_thread
from dflash_models.tiny import qwen3_config
from dflash_models.tokenizer import special_ids


@dataclass(frozen=True)
class TargetSpec:
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True
    seq_len: int = 256
    batch_size: int = 16
    steps: int = 900
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_windows: int = 192
    seed: int = 0


def target_config(spec: TargetSpec, ids: dict[str, int]):
    """The trained target's Qwen3 config: the tiny pair's builder with this spec's shape (a tied head; initialised
    as transformers does)."""
    return qwen3_config(spec, ids, tie_word_embeddings=spec.tie_word_embeddings, initializer_range=0.02)


def lr_at(step: int, spec: TargetSpec, time_frac: float = 0.0) -> float:
    """Linear warmup, then cosine down to min_lr_ratio * lr. Progress is the larger of the step
    fraction and `time_frac` (elapsed / time budget), so a time-capped run still anneals."""
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    t = max((step - spec.warmup) / max(1, spec.steps - spec.warmup), time_frac)
    return spec.lr * (spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def param_groups(model, weight_decay: float) -> list[dict]:
    """No decay on norms and embeddings."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "embed" in name else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def sample_batch(stream, batch: int, seq: int, gen):
    import torch

    starts = torch.randint(0, len(stream) - seq - 1, (batch,), generator=gen)
    return torch.stack([stream[s:s + seq] for s in starts.tolist()])


def evaluate(model, stream, seq: int, windows: int, batch: int = 16) -> float:
    """Mean next-token loss over up to `windows` consecutive non-overlapping windows."""
    import torch

    n = min(windows, (len(stream) - 1) // seq)
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for i in range(0, n, batch):
            x = torch.stack([stream[j * seq:(j + 1) * seq] for j in range(i, min(n, i + batch))])
            total += model(input_ids=x, labels=x).loss.item() * x.shape[0]
            count += x.shape[0]
    model.train()
    return total / max(count, 1)


def train(out_dir: str | Path, spec: TargetSpec = TargetSpec(), time_budget_s: float | None = None,
          log=print) -> dict:
    import torch
    from transformers import Qwen3ForCausalLM

    t_start = time.perf_counter()
    out_dir = Path(out_dir)
    split = corpus.split_files(corpus.stdlib_files())
    log(f"[target] corpus: {len(split.train)} train files, {len(split.heldout)} held-out files")
    tok = data.build_tokenizer(out_dir, spec.vocab_size, split.train)
    ids = special_ids(tok)
    train_ids = torch.tensor(data.token_stream(tok, split.train, spec.seed), dtype=torch.long)
    held_ids = torch.tensor(data.token_stream(tok, split.heldout, spec.seed), dtype=torch.long)
    log(f"[target] tokens: {len(train_ids):,} train, {len(held_ids):,} held-out "
        f"({fmt_secs(time.perf_counter() - t_start)} for tokenizer + data)")

    torch.manual_seed(spec.seed)
    gen = torch.Generator().manual_seed(spec.seed)
    cfg = target_config(spec, ids)
    cfg._attn_implementation = "sdpa"
    model = Qwen3ForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"[target] Qwen3 {spec.num_layers}L d{spec.hidden_size} ff{spec.intermediate_size}: {n_params / 1e6:.2f}M params; "
        f"{spec.steps} steps x {spec.batch_size}x{spec.seq_len} tokens")
    opt = torch.optim.AdamW(param_groups(model, spec.weight_decay), lr=spec.lr, betas=(0.9, 0.95), eps=1e-8)
    prog = Progress("target", spec.steps, every=10)
    ema, curve, stopped_at = None, [], None
    t_train = time.perf_counter()
    for step in range(1, spec.steps + 1):
        time_frac = 0.0 if time_budget_s is None else (time.perf_counter() - t_train) / time_budget_s
        for g in opt.param_groups:
            g["lr"] = lr_at(step - 1, spec, time_frac)
        x = sample_batch(train_ids, spec.batch_size, spec.seq_len, gen)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 10 == 0:
            curve.append((step, round(ema, 4)))
        prog.update(step, tokens=x.numel(), loss=ema, lr=opt.param_groups[0]["lr"])
        if time_frac >= 1.0 and step < spec.steps:
            stopped_at = step
            log(f"[target] time budget reached: stopping at step {step}/{spec.steps}")
            break
    train_s = time.perf_counter() - t_train
    held_loss = evaluate(model, held_ids, spec.seq_len, spec.eval_windows)
    train_loss = evaluate(model, train_ids[: spec.eval_windows * spec.seq_len + 1], spec.seq_len, spec.eval_windows)
    log(f"[target] held-out loss {held_loss:.4f} (ppl {math.exp(held_loss):.2f}), train loss {train_loss:.4f}; "
        f"training {fmt_secs(train_s)}")

    model.config.use_cache = True
    model.to(torch.bfloat16).save_pretrained(out_dir)
    model.generation_config.save_pretrained(out_dir)
    meta = {
        "spec": asdict(spec), "params": n_params, "train_tokens": len(train_ids), "heldout_tokens": len(held_ids),
        "tokens_seen": prog.tokens, "steps_done": stopped_at or spec.steps, "train_seconds": round(train_s, 1),
        "total_seconds": round(time.perf_counter() - t_start, 1), "heldout_loss": round(held_loss, 4),
        "train_loss": round(train_loss, 4), "loss_curve": curve, "torch_threads": torch.get_num_threads(),
    }
    (out_dir / "train_meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    log(f"[target] saved -> {out_dir} ({fmt_secs(time.perf_counter() - t_start)} in all)")
    return meta


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--steps", type=int, default=TargetSpec.steps)
    p.add_argument("--batch-size", type=int, default=TargetSpec.batch_size)
    p.add_argument("--seq-len", type=int, default=TargetSpec.seq_len)
    p.add_argument("--layers", type=int, default=TargetSpec.num_layers)
    p.add_argument("--hidden", type=int, default=TargetSpec.hidden_size)
    p.add_argument("--intermediate", type=int, default=TargetSpec.intermediate_size)
    p.add_argument("--lr", type=float, default=TargetSpec.lr)
    p.add_argument("--seed", type=int, default=TargetSpec.seed)
    p.add_argument("--time-budget-min", type=float, default=None,
                   help="stop after this many minutes of training; the LR schedule then follows elapsed time "
                        "(not bit-reproducible across machines)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 on a small shared machine)")
    a = p.parse_args(argv)
    single_thread(a.threads)
    spec = TargetSpec(steps=a.steps, batch_size=a.batch_size, seq_len=a.seq_len, num_layers=a.layers,
                      hidden_size=a.hidden, intermediate_size=a.intermediate, lr=a.lr, seed=a.seed)
    train(a.out_dir, spec, None if a.time_budget_min is None else 60 * a.time_budget_min)


if __name__ == "__main__":
    main()
