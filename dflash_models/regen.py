"""Regenerate training responses with the target (the DFlash recipe: the drafter learns the
target's own greedy continuations, not the corpus text).

    python -m dflash_models.regen models/tiny-code/target /tmp/regen.pt [--prompts 3072 --max-new 160]

Prompts are cut from the TRAINING split (code prefixes and chat prompts); held-out files stay
for the benchmark. Output: a torch file with `sequences` (prompt + greedy response token ids,
cut after the first end token) and `response_start` per sequence.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from dflash_models import corpus, data
from dflash_models.progress import Progress, fmt_secs, single_thread


def regenerate(target_dir: str | Path, n_prompts: int = 3072, max_new: int = 160, batch_size: int = 48,
               seed: int = 1, max_prompt_tokens: int = 192, time_budget_s: float | None = None, log=print) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    stop = {tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")}
    pad = tok.convert_tokens_to_ids("<|endoftext|>")
    split = corpus.split_files(corpus.stdlib_files())
    prompts = data.prompts(split.train, n_prompts, seed)
    enc = [ids[-max_prompt_tokens:] for ids in tok([p.text for p in prompts], add_special_tokens=False)["input_ids"]]
    # Batches of similar prompt lengths (less padding) within chunks of the prompt order, so a run
    # stopped by the time budget still covers every kind and length of prompt.
    chunk = batch_size * 8
    order = [i for c in range(0, len(enc), chunk) for i in sorted(range(c, min(c + chunk, len(enc))),
                                                                   key=lambda i: len(enc[i]))]
    sequences: list[list[int]] = [[] for _ in enc]
    starts = [len(e) for e in enc]
    n_batches = (len(order) + batch_size - 1) // batch_size
    prog = Progress("regen", n_batches, every=1)
    for b in range(n_batches):
        idx = order[b * batch_size:(b + 1) * batch_size]
        width = max(len(enc[i]) for i in idx)
        x = torch.tensor([[pad] * (width - len(enc[i])) + enc[i] for i in idx])
        att = torch.tensor([[0] * (width - len(enc[i])) + [1] * len(enc[i]) for i in idx])
        with torch.no_grad():
            out = model.generate(input_ids=x, attention_mask=att, max_new_tokens=max_new, do_sample=False,
                                 pad_token_id=pad, eos_token_id=sorted(stop))
        new = 0
        for row, i in enumerate(idx):
            resp = out[row, width:].tolist()
            cut = next((j + 1 for j, t in enumerate(resp) if t in stop), len(resp))
            sequences[i] = enc[i] + resp[:cut]
            new += cut
        prog.update(b + 1, tokens=new)
        if time_budget_s is not None and prog.elapsed > time_budget_s and b + 1 < n_batches:
            log(f"[regen] time budget reached after {b + 1}/{n_batches} batches")
            break
    done = [i for i, s in enumerate(sequences) if s]
    sequences, starts, prompts = [sequences[i] for i in done], [starts[i] for i in done], [prompts[i] for i in done]
    n_resp = sum(len(s) - st for s, st in zip(sequences, starts))
    log(f"[regen] {len(sequences)} sequences, {n_resp:,} response tokens in {fmt_secs(time.perf_counter() - t0)}")
    return {"sequences": sequences, "response_start": starts, "kinds": [p.kind for p in prompts],
            "seconds": time.perf_counter() - t0, "max_new": max_new, "seed": seed}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("target_dir")
    p.add_argument("out_file")
    p.add_argument("--prompts", type=int, default=3072)
    p.add_argument("--max-new", type=int, default=160)
    p.add_argument("--batch-size", type=int, default=48)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--time-budget-min", type=float, default=None, help="stop after this many minutes")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    single_thread(a.threads)
    import torch

    budget = None if a.time_budget_min is None else 60 * a.time_budget_min
    torch.save(regenerate(a.target_dir, a.prompts, a.max_new, a.batch_size, a.seed, time_budget_s=budget), a.out_file)


if __name__ == "__main__":
    main()
