"""Rebuild the bundled model pair from scratch: target, regenerated data, drafter, model card.

    python -m dflash_models.build models/tiny-code            # from a checkout: it needs the dev harness
    python -m dflash_models.build models/tiny-code --skip-target   # keep the target, retrain the drafter

Two torch threads by default (`--threads`, 1 on a shared machine); every stage prints progress lines with step, loss,
tokens/s and ETA. Fixed seeds: the same Python version (same stdlib corpus) and torch build
give the same data and, up to floating-point summation order, the same weights, as long as
the step counts bind. `--target-budget-min` / `--drafter-budget-min` (defaults 42 / 40) cap the
training time on a slow or busy machine: the learning-rate schedule then anneals by elapsed
time and the run is no longer bit-reproducible (0 = no cap). Raise `--target-steps` /
`--drafter-steps` and the budgets to train longer.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from dflash_models.progress import fmt_secs, single_thread

REPO = Path(__file__).resolve().parents[1]
ACCEPTANCE_RESULTS = REPO / "benchmarks" / "results" / "acceptance_cpu.json"


def _size_mb(d: Path) -> float:
    return sum(f.stat().st_size for f in d.rglob("*") if f.is_file()) / 1e6


def _threads(meta: dict) -> str:
    n = meta.get("torch_threads", 1)
    return f"{n} torch thread{'s' if n != 1 else ''}"


def write_card(out_dir: str | Path, acceptance: Path | None = ACCEPTANCE_RESULTS) -> Path:
    """models/<pair>/README.md from the two train_meta.json files (and the benchmark, if run)."""
    out_dir = Path(out_dir)
    t = json.loads((out_dir / "target" / "train_meta.json").read_text())
    d = json.loads((out_dir / "drafter" / "train_meta.json").read_text())
    tcfg = json.loads((out_dir / "target" / "config.json").read_text())
    dcfg = json.loads((out_dir / "drafter" / "config.json").read_text())
    ts, ds = t["spec"], d["spec"]
    lines = [
        f"# {out_dir.name}: the embedded default model pair",
        "",
        "A small Qwen3 code model and its DFlash drafter, trained in this repository on CPU from the Python",
        "standard library's own sources (nothing downloaded). The default `dflash-serve` config",
        "(`deploy/configs/cpu.yaml`) serves this pair with DFlash on CPU.",
        "",
        "| | target (`target/`) | drafter (`drafter/`) |",
        "|---|---|---|",
        f"| architecture | Qwen3ForCausalLM, {tcfg['num_hidden_layers']} layers, hidden {tcfg['hidden_size']}, "
        f"MLP {tcfg['intermediate_size']}, {tcfg['num_attention_heads']} heads / {tcfg['num_key_value_heads']} KV heads, "
        f"tied embeddings | DFlashDraftModel (z-lab format), {dcfg['num_hidden_layers']} layers, block "
        f"{dcfg['block_size']}, target_layer_ids {dcfg['dflash_config']['target_layer_ids']}, mask token id "
        f"{dcfg['dflash_config']['mask_token_id']} |",
        f"| parameters | {t['params'] / 1e6:.2f} M | {d['params'] / 1e6:.2f} M (+ the target's frozen embedding / LM head) |",
        f"| files | {_size_mb(out_dir / 'target'):.1f} MB (bf16 safetensors) | {_size_mb(out_dir / 'drafter'):.1f} MB (bf16 safetensors) |",
        f"| vocabulary | {tcfg['vocab_size']} byte-level BPE tokens, ChatML template, `<\\|mask\\|>` for DFlash | shared |",
        f"| training data | {t['train_tokens']:,} tokens: stdlib .py files (train split) + chat turns cut from them | "
        f"{d['regen_sequences']:,} greedy responses of the target (up to {d['regen_max_new']} tokens) to code and chat "
        f"prompts from the train split, as many as the regeneration time budget allowed |",
        f"| training | {t['steps_done']} steps x {ts['batch_size']}x{ts['seq_len']} tokens ({t['tokens_seen']:,} tokens), "
        f"AdamW lr {ts['lr']} cosine, seed {ts['seed']} | {d['steps_done']} steps x {ds['batch_size']} sequences x "
        f"{ds['anchors']} random anchors, gamma {ds['gamma']}, AdamW lr {ds['lr']} cosine, seed {ds['seed']} |",
        f"| time (CPU) | {fmt_secs(t['train_seconds'])} training, {fmt_secs(t['total_seconds'])} in all, "
        f"{_threads(t)} | {fmt_secs(d['regen_seconds'])} regenerating (SGLang server, 64 concurrent) + "
        f"{fmt_secs(d['train_seconds'])} training, {fmt_secs(d['regen_seconds'] + d['total_seconds'])} in all, "
        f"{_threads(d)} |",
        f"| loss | held-out {t['heldout_loss']:.3f} nats/token (train {t['train_loss']:.3f}) | held-out weighted "
        f"block loss {d['heldout']['loss']:.3f}; first-draft accuracy {d['heldout']['acc1']:.3f}; offline accepted "
        f"length {d['heldout']['tau']:.2f} |",
        "",
        "Held-out = the stdlib files whose name hashes into the 5% held-out split (`dflash_models/corpus.py`);",
        "the drafter's held-out figures are on regenerated sequences kept out of its training, whose prompts come",
        "from the train split (many of the weak target's responses there are repetitive loops, which is why the",
        "offline accepted length is far above the one measured through the server on held-out files below).",
        "",
    ]
    capped = [name for name, m in (("target", t), ("drafter", d)) if m["steps_done"] < m["spec"]["steps"]]
    if capped:
        lines += [
            f"The {' and '.join(capped)} training stopped at the time budget (step counts above) on a shared 2-core",
            "machine; the learning rate then anneals by elapsed time, so a rebuild on another machine trains a",
            "different number of steps. `--target-budget-min 0 --drafter-budget-min 0` runs the full step counts.",
            "",
        ]
    lines += ["## Measured through the server (CPU)", ""]
    if acceptance is not None and acceptance.is_file():
        r = json.loads(acceptance.read_text())
        lines += [f"`benchmarks/acceptance.py`, greedy, {r['n_prompts']} held-out prompts, {r['max_new_tokens']} new "
                  f"tokens, block {r['block_size']}, concurrency 1, server.cpu_threads {r['threads']}:", "", r["table"], ""]
    else:
        lines += ["Not measured yet: run `python benchmarks/acceptance.py`.", ""]
    lines += [
        "## Rebuild",
        "",
        "```bash",
        f"python -m dflash_models.build {out_dir.relative_to(REPO) if out_dir.is_relative_to(REPO) else out_dir}"
        "     # from a checkout",
        "python benchmarks/acceptance.py                # acceptance and speedup through real servers",
        "```",
        "",
        "Stages, each also runnable alone: `python -m dflash_models.train_target`, `python -m dflash_models.regen`,",
        "`python -m dflash_models.train_drafter`. Same seeds and Python version give the same data; weights",
        "match up to floating-point summation order (thread count, CPU). The stored weights are bf16; the",
        "server loads them into its float32 model exactly.",
        "",
    ]
    card = out_dir / "README.md"
    card.write_text("\n".join(lines))
    return card


def build(out_dir: str | Path, *, target_steps: int | None = None, target_budget_min: float | None = 42,
          regen_prompts: int = 8192, regen_max_new: int = 160, regen_budget_min: float | None = 15,
          drafter_steps: int | None = None,
          drafter_budget_min: float | None = 40, skip_target: bool = False, threads: int = 2, log=print) -> Path:
    import torch

    from dflash_models import regen, train_drafter, train_target

    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    target_dir, drafter_dir = out_dir / "target", out_dir / "drafter"
    if skip_target and (target_dir / "model.safetensors").is_file():
        log(f"[build] keeping the target in {target_dir}")
    else:
        spec = train_target.TargetSpec(**({"steps": target_steps} if target_steps else {}))
        train_target.train(target_dir, spec, None if target_budget_min is None else 60 * target_budget_min, log=log)
    data = regen.regenerate(target_dir, regen_prompts, regen_max_new, threads=threads, log=log,
                            time_budget_s=None if regen_budget_min is None else 60 * regen_budget_min)
    cache = REPO / "build" / f"{out_dir.name}-regen.pt"  # for drafter-only reruns (train_drafter --data)
    cache.parent.mkdir(exist_ok=True)
    torch.save(data, cache)
    log(f"[build] regenerated data saved to {cache}")
    dspec = train_drafter.DrafterSpec(**({"steps": drafter_steps} if drafter_steps else {}))
    train_drafter.train(target_dir, drafter_dir, data, dspec,
                        None if drafter_budget_min is None else 60 * drafter_budget_min, log=log)
    card = write_card(out_dir)
    log(f"[build] done in {fmt_secs(time.perf_counter() - t0)}: {out_dir} ({_size_mb(out_dir):.1f} MB), card {card}")
    return out_dir


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out_dir", help="directory to create (target/, drafter/, README.md)")
    p.add_argument("--target-steps", type=int, default=None, help="default: TargetSpec.steps")
    p.add_argument("--target-budget-min", type=float, default=42, help="minutes; stop target training then, annealing by time (0 = no cap)")
    p.add_argument("--regen-prompts", type=int, default=8192)
    p.add_argument("--regen-max-new", type=int, default=160)
    p.add_argument("--regen-budget-min", type=float, default=15, help="minutes; stop regenerating then (0 = no cap)")
    p.add_argument("--drafter-steps", type=int, default=None, help="default: DrafterSpec.steps")
    p.add_argument("--drafter-budget-min", type=float, default=40, help="minutes; stop drafter training then, annealing by time (0 = no cap)")
    p.add_argument("--skip-target", action="store_true", help="reuse an existing target, retrain the drafter")
    p.add_argument("--card-only", action="store_true", help="only rewrite README.md from the training metadata")
    p.add_argument("--threads", type=int, default=2,
                   help="torch threads for training and the regeneration server (1 on a shared machine)")


def run(a: argparse.Namespace) -> int:
    if a.card_only:
        print(write_card(a.out_dir))
        return 0
    single_thread(a.threads)
    build(a.out_dir, target_steps=a.target_steps, target_budget_min=a.target_budget_min or None,
          regen_prompts=a.regen_prompts, regen_max_new=a.regen_max_new,
          regen_budget_min=a.regen_budget_min or None, drafter_steps=a.drafter_steps,
          drafter_budget_min=a.drafter_budget_min or None, skip_target=a.skip_target, threads=a.threads)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
