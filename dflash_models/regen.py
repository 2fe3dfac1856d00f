"""Regenerate training responses with the target (the DFlash recipe: the drafter learns the
target's own greedy continuations, not the corpus text).

    python -m dflash_models.regen models/tiny-code/target /tmp/regen.pt [--prompts 8192 --max-new 160]

The target is served by SGLang on CPU (`dflash-serve serve`, no speculation) and the prompts are
sent concurrently to its native `/generate` endpoint: continuous batching makes this several times
faster than `transformers.generate` over padded batches, and the responses are exactly what the
server's greedy decoding produces, i.e. what the drafter has to predict at serving time.

Prompts are cut from the TRAINING split (code prefixes and chat prompts); held-out files stay
for the benchmark. Output: a torch file with `sequences` (prompt + greedy response token ids,
cut after the first end token) and `response_start` per sequence.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

from dflash_models import corpus, data
from dflash_models.progress import Progress, fmt_secs


def server_config(target_dir: str | Path, concurrency: int, threads: int | str) -> dict:
    """A plain (non-speculative) CPU server for the target, as `dflash-serve serve` takes it."""
    return {"model": {"path": str(Path(target_dir).resolve()), "dtype": "float32"},
            "server": {"device": "cpu", "cpu_threads": threads, "metrics": False,
                       "max_running_requests": concurrency, "max_total_tokens": 131072},
            "speculative": {"algorithm": "none"},
            "sglang_args": {"chunked_prefill_size": 4096}}


def regenerate(target_dir: str | Path, n_prompts: int = 8192, max_new: int = 160, concurrency: int = 64,
               seed: int = 1, max_prompt_tokens: int = 192, time_budget_s: float | None = None,
               threads: int | str = "auto", log=print) -> dict:
    from transformers import AutoTokenizer

    from harness.server import ManagedServer

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    stop = sorted({tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")})
    split = corpus.split_files(corpus.stdlib_files())
    prompts = data.prompts(split.train, n_prompts, seed)
    enc = [ids[-max_prompt_tokens:] for ids in tok([p.text for p in prompts], add_special_tokens=False)["input_ids"]]
    sequences: list[list[int]] = [[] for _ in enc]

    def one(i: int) -> int:
        # SGLang stops at the first stop token and keeps it in output_ids: the drafter learns where responses end
        resp = server.generate(enc[i], max_new_tokens=max_new, temperature=0, ignore_eos=False,
                               stop_token_ids=stop)["output_ids"]
        sequences[i] = enc[i] + resp
        return len(resp)

    with tempfile.TemporaryDirectory() as work, \
            ManagedServer(server_config(target_dir, concurrency, threads), Path(work), "regen-target") as server:
        log(f"[regen] target served at {server.url} ({fmt_secs(time.perf_counter() - t0)} to start); "
            f"{len(enc)} prompts, {concurrency} concurrent, up to {max_new} new tokens each")
        prog = Progress("regen", len(enc), every=max(1, len(enc) // 100))
        t_gen, done, new_tokens, pending, nxt = time.perf_counter(), 0, 0, set(), 0
        with ThreadPoolExecutor(concurrency) as pool:
            while nxt < len(enc) or pending:
                over = time_budget_s is not None and time.perf_counter() - t_gen > time_budget_s
                while not over and nxt < len(enc) and len(pending) < concurrency:  # order kept: a budget cut
                    pending.add(pool.submit(one, nxt))                             # still covers every kind
                    nxt += 1
                if over and nxt < len(enc):
                    log(f"[regen] time budget reached after {nxt}/{len(enc)} prompts submitted")
                    nxt = len(enc)
                if not pending:
                    break
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in finished:
                    n = f.result()
                    new_tokens += n
                    done += 1
                    prog.update(done, tokens=n)
    kept = [i for i, s in enumerate(sequences) if s]
    out = {"sequences": [sequences[i] for i in kept], "response_start": [len(enc[i]) for i in kept],
           "kinds": [prompts[i].kind for i in kept], "seconds": time.perf_counter() - t0, "max_new": max_new,
           "seed": seed}
    log(f"[regen] {len(kept)} sequences, {new_tokens:,} response tokens in {fmt_secs(out['seconds'])}")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("target_dir")
    p.add_argument("out_file")
    p.add_argument("--prompts", type=int, default=8192)
    p.add_argument("--max-new", type=int, default=160)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--time-budget-min", type=float, default=None, help="stop submitting prompts after this many minutes")
    p.add_argument("--threads", default="auto", help="server CPU threads (default: auto)")
    a = p.parse_args(argv)
    import torch

    budget = None if a.time_budget_min is None else 60 * a.time_budget_min
    threads = a.threads if a.threads == "auto" else int(a.threads)
    torch.save(regenerate(a.target_dir, a.prompts, a.max_new, a.concurrency, a.seed, time_budget_s=budget,
                          threads=threads), a.out_file)


if __name__ == "__main__":
    main()
