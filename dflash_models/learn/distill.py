"""Fine-tune a copy of the serving drafter on captured traffic, with the bundled pair's recipe (train_drafter.py):
the target's features regenerated for every sequence (`precompute_features`), random anchors inside each response,
block masks and exp(-(k-1)/gamma) position weights (`drafter_model.dflash_loss`), AdamW with warmup and cosine.

Each batch mixes `original_share` of the original data -- the target's own greedy responses to the operator's prompts
(`learning.dataset`), or for the bundled pair to prompts of its training split, generated once and cached in the
work dir -- so the old domain is not forgotten.

Device and dtype come from the config (`learning.device`, `learning.dtype`): the frozen target is loaded in that
dtype on that device; the drafter trains there in float32 weights (AdamW's state too), its matmuls under autocast to
the target's dtype when that is not float32. Features are kept in host memory, a batch at a time on the device.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import random
import time
from pathlib import Path
from typing import Callable

from dflash_models.progress import Progress

Item = tuple  # (token ids, response start, target features [S, K*H])


@dataclasses.dataclass(frozen=True)
class FinetuneSpec:
    steps: int = 150
    batch_size: int = 16  # sequences per step (the recipe's)
    anchors: int = 16  # blocks per sequence (the recipe's)
    lr: float = 5e-4  # below the recipe's 2e-3: a copy of a trained drafter, not a fresh one
    warmup: int = 10
    original_share: float = 0.25
    seed: int = 0


class Pair:
    """The frozen target (features, embedding, LM head) and its tokenizer, loaded once per learner process."""

    def __init__(self, target_dir: str | Path, device: str = "cpu", dtype: str = "float32") -> None:
        import torch
        from transformers import AutoTokenizer

        from dflash_models.train_drafter import load_target

        self.dir = Path(target_dir)
        self.device, self.dtype = torch.device(device), getattr(torch, dtype)
        self.target = load_target(self.dir, dtype, device)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.dir))
        self.embed = self.target.get_input_embeddings()
        self.head_w = self.target.get_output_embeddings().weight

    def autocast(self):
        """The drafter's forward in the target's dtype (its float32 weights cast per matmul); float32: as is."""
        return autocast_like(self.head_w)

    def stop_ids(self) -> list[int]:
        return sorted({self.tokenizer.convert_tokens_to_ids("<|im_end|>"),
                       self.tokenizer.convert_tokens_to_ids("<|endoftext|>")})

    def items(self, sequences: list[list[int]], starts: list[int], layer_ids: list[int], log=print) -> list[Item]:
        from dflash_models.train_drafter import precompute_features

        keep = [i for i in range(len(sequences)) if len(sequences[i]) - starts[i] >= 2]
        feats = precompute_features(self.target, [sequences[i] for i in keep], layer_ids, log=log)
        return [(sequences[i], starts[i], f) for i, f in zip(keep, feats)]


def autocast_like(weight):
    """Autocast to `weight`'s dtype on its device (the target's), or nothing for float32."""
    import torch

    if weight.dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=weight.device.type, dtype=weight.dtype)


def load_drafter(path: str | Path):
    """The z-lab checkpoint as the training-time module (float32) and its config."""
    import torch
    from safetensors.torch import load_file

    from dflash_models.drafter_model import DFlashDrafter

    cfg = json.loads((Path(path) / "config.json").read_text())
    drafter = DFlashDrafter(cfg)
    sd = {k: v.to(torch.float32) for k, v in load_file(str(Path(path) / "model.safetensors")).items()}
    drafter.load_state_dict(sd)
    return drafter.eval(), cfg


def save_drafter(drafter, cfg: dict, out: Path, tokenizer_dir: Path) -> None:
    import torch

    from dflash_models.tiny import save_drafter as save

    save(out, cfg, {k: v.detach().to("cpu", torch.bfloat16) for k, v in drafter.state_dict().items()},
         tokenizer_dir)


def original_mix(pair: Pair, n: int, split: str, seed: int, max_new: int, cache: Path, log=print,
                 batch: int = 16, max_prompt_tokens: int = 192,
                 prompts: list[list[int]] | None = None) -> tuple[list[list[int]], list[int]]:
    """The target's greedy responses to `prompts` (token ids: the operator's dataset, dataset.py), or without them to
    `n` prompts of the bundled pair's corpus `split` ("train": the drafter's own data mix; "heldout": its files never
    trained on), cached in `cache` (generated once: prompts and weights are fixed)."""
    import torch

    from dflash_models import corpus, data

    if cache.is_file():
        d = torch.load(cache)
        return d["sequences"], d["starts"]
    t0 = time.perf_counter()
    tok = pair.tokenizer
    if prompts is None:
        parts = corpus.split_files(corpus.stdlib_files())
        texts = [p.text for p in data.prompts(parts.train if split == "train" else parts.heldout, n, seed)]
        enc = [ids[-max_prompt_tokens:] for ids in tok(texts, add_special_tokens=False)["input_ids"]]
    else:
        enc = [ids[-max_prompt_tokens:] for ids in prompts]
    stop = set(pair.stop_ids())
    seqs, starts = [], []
    for b in range(0, len(enc), batch):
        chunk = enc[b:b + batch]
        width = max(len(x) for x in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for r, x in enumerate(chunk):  # left padding: generation continues every row at the same column
            ids[r, width - len(x):] = torch.tensor(x)
            mask[r, width - len(x):] = 1
        with torch.no_grad():
            ids, mask = ids.to(pair.device), mask.to(pair.device)
            out = pair.target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
                                       eos_token_id=sorted(stop), pad_token_id=0)
        for r, x in enumerate(chunk):
            resp = out[r, width:].tolist()
            cut = next((i + 1 for i, t in enumerate(resp) if t in stop), len(resp))
            seqs.append(list(x) + resp[:cut])
            starts.append(len(x))
    log(f"[learn] original mix ({split}): {len(seqs)} responses of the target in {time.perf_counter() - t0:.0f}s")
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"sequences": seqs, "starts": starts}, cache)
    return seqs, starts


def finetune(drafter, pair: Pair, captured: list[Item], original: list[Item], spec: FinetuneSpec,
             on_step: Callable[[int, float, int], None] | None = None, log=print) -> dict:
    """Fine-tune `drafter` in place; returns {loss, tau, tokens, seconds}. `on_step(step, loss_ema, tokens)`."""
    import torch

    from dflash_models.drafter_model import block_labels, dflash_loss
    from dflash_models.train_drafter import DrafterSpec, lr_at, make_batch

    recipe = DrafterSpec(block_size=drafter.block_size, batch_size=spec.batch_size, anchors=spec.anchors,
                         steps=spec.steps, lr=spec.lr, warmup=spec.warmup, seed=spec.seed)
    torch.manual_seed(spec.seed)
    rng = random.Random(spec.seed)
    device = pair.head_w.device
    drafter.to(device).train()
    decay = [p for p in drafter.parameters() if p.ndim >= 2]
    no_decay = [p for p in drafter.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": recipe.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=spec.lr, betas=(0.9, 0.95))
    n_orig = int(round(spec.original_share * spec.batch_size)) if original else 0
    prog = Progress("learn", spec.steps, every=10)
    ema: dict[str, float] = {}
    tokens, t0 = 0, time.perf_counter()
    for step in range(1, spec.steps + 1):
        batch = [rng.choice(original) for _ in range(n_orig)] + \
                [rng.choice(captured) for _ in range(spec.batch_size - n_orig)]
        for g in opt.param_groups:
            g["lr"] = lr_at(step - 1, recipe)
        tok, f, anchors, ends = (t.to(device) for t in make_batch(batch, spec.anchors, recipe.block_size, rng))
        with autocast_like(pair.head_w):
            hidden = drafter(f, tok, anchors, pair.embed)
            labels, valid = block_labels(tok, anchors, recipe.block_size, ends)
            loss, st = dflash_loss(hidden, labels, valid, pair.head_w, recipe.gamma)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), recipe.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        for k, v in (("loss", loss.item()), ("tau", st["tau"])):
            ema[k] = v if k not in ema else 0.9 * ema[k] + 0.1 * v
        n_tok = int(valid.sum())
        tokens += n_tok
        prog.update(step, tokens=n_tok, loss=ema["loss"], tau=ema["tau"], lr=opt.param_groups[0]["lr"])
        if on_step is not None:
            on_step(step, ema["loss"], n_tok)
    drafter.eval()
    return {"loss": round(ema["loss"], 4), "tau": round(ema["tau"], 3), "tokens": tokens,
            "seconds": round(time.perf_counter() - t0, 1)}
