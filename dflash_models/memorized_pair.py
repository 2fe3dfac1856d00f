"""A tiny pair trained in about a minute on CPU to memorize a small corpus, so drafts are accepted several at a time.

Why: a random pair rarely accepts a draft, so the multi-token accept path -- for a hybrid target, the commit of
the recurrent state after exactly the accepted prefix -- barely runs. Here a family's random target (e.g. the
Qwen3.5 hybrid of `family_qwen3_5.py`) is trained briefly on a few dozen stdlib snippets until its greedy
continuation of a snippet's opening is the snippet, its own greedy responses are regenerated, and a DFlash drafter
is trained on them with the bundled pair's recipe (`train_drafter.train`: anchors, block masks, decayed position
weights, the target's features). Prompted with the snippets' openings (`prompts`), the pair then commits several
tokens a step. Deterministic for a given Python (the stdlib is the corpus) and torch build.

    python -m dflash_models.memorized_pair /tmp/hybrid-trained
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class MemorizedSpec:
    snippets: int = 24  # stdlib files, the first `snippet_tokens` tokens of each
    snippet_tokens: int = 96
    prompt_tokens: int = 16  # a prompt is a snippet's opening; the target's greedy continuation is the rest
    target_steps: int = 120
    target_lr: float = 3e-3
    drafter_steps: int = 1500
    drafter_lr: float = 5e-3
    block_size: int = 8
    seed: int = 0


def snippets(tokenizer, spec: MemorizedSpec) -> list[list[int]]:
    """The corpus: the first tokens of the first stdlib files long enough to give them (sorted, so stable)."""
    from dflash_models import corpus

    out = []
    for path in corpus.stdlib_files():
        ids = tokenizer(corpus.read_text(path))["input_ids"]
        if len(ids) >= spec.snippet_tokens:
            out.append(ids[: spec.snippet_tokens])
        if len(out) == spec.snippets:
            return out
    raise RuntimeError(f"only {len(out)} stdlib files have {spec.snippet_tokens} tokens")


def prompts(target_dir: str | Path, spec: MemorizedSpec = MemorizedSpec()) -> list[list[int]]:
    """Token ids of the prompts the pair was trained to continue (each snippet's opening)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    return [s[: spec.prompt_tokens] for s in snippets(tok, spec)]


def train_target(target_dir: Path, spec: MemorizedSpec, log=print) -> float:
    """Teacher-forced next-token training of the target in `target_dir` on the snippets, saved back in its dtype.
    Returns the final loss."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target_dir))
    data = torch.tensor(snippets(tok, spec))
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    saved_dtype = model.config.dtype if hasattr(model.config, "dtype") else torch.bfloat16
    torch.manual_seed(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.target_lr, weight_decay=0.0)
    model.train()
    loss = float("nan")
    t0 = time.perf_counter()
    for step in range(1, spec.target_steps + 1):
        out = model(input_ids=data, labels=data)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = out.loss.item()
        if step % 50 == 0 or step == spec.target_steps:
            log(f"[memorized] target step {step}/{spec.target_steps} loss {loss:.4f} "
                f"({time.perf_counter() - t0:.0f}s)")
    model.eval()
    model.to(saved_dtype or torch.bfloat16).save_pretrained(str(target_dir))
    return loss


def regenerate(target_dir: Path, spec: MemorizedSpec) -> dict:
    """The served target's own greedy responses to the prompts (the drafter's training data, as `regen.py` makes
    them through a server), from the saved weights."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    ps = prompts(target_dir, spec)
    with torch.no_grad():
        out = model.generate(torch.tensor(ps), max_new_tokens=spec.snippet_tokens - spec.prompt_tokens,
                             do_sample=False, pad_token_id=0)
    return {"sequences": out.tolist(), "response_start": [spec.prompt_tokens] * len(ps),
            "max_new": spec.snippet_tokens - spec.prompt_tokens}


def build(target_dir: str | Path, drafter_dir: str | Path, spec: MemorizedSpec = MemorizedSpec(), log=print) -> dict:
    """Train the random target in `target_dir` in place, then a drafter for it into `drafter_dir`. Returns the
    final training losses and the seconds each took."""
    from dflash_models import train_drafter

    t0 = time.perf_counter()
    loss = train_target(Path(target_dir), spec, log=log)
    t1 = time.perf_counter()
    regen = regenerate(Path(target_dir), spec)
    # nothing held out: the pair is meant to continue exactly these prompts (the served acceptance is the measure)
    dspec = train_drafter.DrafterSpec(num_layers=1, block_size=spec.block_size, gamma=4.0, batch_size=8, anchors=8,
                                      steps=spec.drafter_steps, lr=spec.drafter_lr, warmup=20, eval_sequences=0,
                                      seed=spec.seed)
    meta = train_drafter.train(target_dir, drafter_dir, regen, dspec, log=log)
    curve = meta["loss_curve"]
    report = {"target_loss": round(loss, 4), "target_seconds": round(t1 - t0, 1),
              "drafter_loss": curve[-1][1] if curve else None, "drafter_seconds": round(time.perf_counter() - t1, 1)}
    log(f"[memorized] {json.dumps(report)}")
    return report


def main(argv: list[str] | None = None) -> None:
    from dflash_models import family_qwen3_5

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", help="target/ and drafter/ are written inside (a Qwen3.5 hybrid pair)")
    a = p.parse_args(argv)
    out = Path(a.out_dir)
    pair = family_qwen3_5.build(out)
    build(pair["target"], pair["drafter"])


if __name__ == "__main__":
    main()
