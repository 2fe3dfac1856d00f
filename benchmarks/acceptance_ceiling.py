"""The most any drafter could be accepted on a workload: the target's own peakedness, measured offline.

With a draft verified against the target alone (a proposed token is kept with the target's probability of it, as
DFlash verifies at temperature > 0), the best drafter proposes the target's most likely token at every position,
and the j-th draft token of a block survives with probability prod_{k<=j} max_x p_k(x). So the committed tokens
per step of a block of b are at most E[1 + sum_{j=1}^{b-1} prod_{k<=j} m_k], m_k the target's top probability at
the k-th position of its own sampled continuation. This script samples the target's continuations of a workload's
prompts (transformers, CPU) at a temperature and reports that ceiling per block size next to the mean top
probability. A learning drafter (its target: 1.5x the static drafter's acceptance) cannot pass it, whatever
it learns. Prints a table and writes JSON.

    python benchmarks/acceptance_ceiling.py [--workload prose] [--temperature 1.0] [--prompts 32] [--new 64]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def prompt_texts(workload: str, n: int, tokenizer) -> list[str]:
    out = []
    for line in (REPO / "loadtest/prompts" / f"{workload}.jsonl").read_text().splitlines()[:n]:
        row = json.loads(line)
        if "messages" in row:
            out.append(tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True))
        else:
            out.append(row["prompt"])
    return out


def top_probabilities(model, tokenizer, texts: list[str], new: int, temperature: float, seed: int) -> list[list[float]]:
    """Per prompt, the target's top probability at each position of its own sampled continuation."""
    import torch

    torch.manual_seed(seed)
    rows = []
    for text in texts:
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        tops = []
        with torch.no_grad():
            past = None
            x = ids
            for _ in range(new):
                out = model(input_ids=x, past_key_values=past, use_cache=True)
                past = out.past_key_values
                probs = torch.softmax(out.logits[0, -1].float() / temperature, -1)
                tops.append(float(probs.max()))
                x = torch.multinomial(probs, 1).view(1, 1)
        rows.append(tops)
    return rows


def ceiling(rows: list[list[float]], block: int) -> float:
    """Mean over block starts of 1 + sum_j prod_{k<=j} m_k (module docstring)."""
    total, count = 0.0, 0
    for tops in rows:
        for start in range(len(tops) - block + 1):
            run, acc = 1.0, 1.0
            for k in range(block - 1):
                run *= tops[start + k]
                acc += run
            total += acc
            count += 1
    return total / max(count, 1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=str(REPO / "models/tiny-code/target"))
    p.add_argument("--workload", default="prose", help="a loadtest/prompts/*.jsonl name")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    tok = AutoTokenizer.from_pretrained(a.target)
    model = AutoModelForCausalLM.from_pretrained(a.target, dtype=torch.float32).eval()
    rows = top_probabilities(model, tok, prompt_texts(a.workload, a.prompts, tok), a.new, a.temperature, a.seed)
    flat = [m for r in rows for m in r]
    result = {"workload": a.workload, "temperature": a.temperature, "prompts": len(rows), "new": a.new,
              "mean_top_probability": sum(flat) / len(flat),
              "ceiling_tokens_per_step": {b: ceiling(rows, b) for b in (2, 4, 8, 16)}}
    print(f"{a.workload} at temperature {a.temperature}: mean top probability {result['mean_top_probability']:.3f}")
    print("block | ceiling tokens per step")
    for b, c in result["ceiling_tokens_per_step"].items():
        print(f"{b:5d} | {c:.2f}")
    out = Path(a.out or REPO / "benchmarks/results" / f"acceptance_ceiling_{a.workload}_t{a.temperature:g}.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
