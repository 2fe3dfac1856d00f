"""A DFlash2 drafter made from a DFlash one: the same backbone plus DFlash2's two additions, in SGLang's format.

DFlash2 (SGLang's `DFlash2DraftModel`, sglang/srt/models/dflash.py) adds to the DFlash backbone
- a grouped dynamic depthwise convolution across the block around every attention and MLP sublayer
  (`dflash_config.conv_kernel_size` taps, `conv_group_size` channels a group): `layers.N.{attention,mlp}_conv`
  with `base_kernel` [2, taps, hidden] and `kernel_projection.weight` [2 * taps * groups, hidden];
- a candidate selector (`selector_rank`, `selector_top_k`): the target head's top-k per block position, scored
  pairwise by low-rank predecessor/successor codebooks [vocab, rank] and a projection of the draft hidden state,
  walked to one path (argmax for greedy rows, sampled with its q for sampled rows).

Why convert rather than train: the selector and the convolutions are what the serving code must get right (the
path, its q, the convolution's block layout at every width); a converted drafter keeps the trained backbone's
acceptance, so the multi-token accept path runs, while the added parts are small random perturbations around
identity (convolution: tap 0 one, projection `scale`-sized; codebooks `scale`-sized), so the selector's path and
q differ from the backbone's argmax and one-hot. A DFlash2 checkpoint trained by its authors is served the same way.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path


def convert(drafter_dir: str | Path, out_dir: str | Path, *, conv_kernel_size: int = 3, conv_group_size: int = 16,
            selector_rank: int = 8, selector_top_k: int = 8, scale: float = 0.003, seed: int = 0,
            architecture: str = "DFlash2DraftModel") -> Path:
    """Write `out_dir` (config.json, model.safetensors, tokenizer files): the DFlash drafter in `drafter_dir` with
    DFlash2's convolutions and selector added (module docstring). Returns `out_dir`."""
    import torch
    from safetensors.torch import load_file, save_file

    src, out = Path(drafter_dir), Path(out_dir)
    cfg = json.loads((src / "config.json").read_text())
    hidden, vocab = int(cfg["hidden_size"]), int(cfg["vocab_size"])
    if hidden % conv_group_size:
        raise ValueError(f"conv_group_size {conv_group_size} must divide the drafter's hidden_size {hidden}")
    cfg["architectures"] = [architecture]
    cfg["dflash_config"] = dict(cfg.get("dflash_config", {}), conv_kernel_size=conv_kernel_size,
                                conv_group_size=conv_group_size, selector_rank=selector_rank,
                                selector_top_k=selector_top_k)
    weights = load_file(str(src / "model.safetensors"))
    dtype = next(iter(weights.values())).dtype
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    groups = hidden // conv_group_size
    for layer in range(int(cfg["num_hidden_layers"])):
        for conv in ("attention_conv", "mlp_conv"):
            base = torch.zeros(2, conv_kernel_size, hidden)
            base[:, 0] = 1.0  # identity at tap 0; the projection adds the input-dependent taps
            weights[f"layers.{layer}.{conv}.base_kernel"] = base.to(dtype)
            weights[f"layers.{layer}.{conv}.kernel_projection.weight"] = rand(2 * conv_kernel_size * groups, hidden)
    # pairwise scores <A[pred] * W h, B[c]> of a few tenths of a logit (codebooks ~1, W h ~0.15 for a normed
    # hidden state): they reorder close candidates, not the backbone's confident ones
    weights["candidate_selector.predecessor_codebook"] = rand(vocab, selector_rank) / scale
    weights["candidate_selector.successor_codebook"] = rand(vocab, selector_rank) / scale
    weights["candidate_selector.hidden_projection.weight"] = rand(selector_rank, hidden) * 3
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("drafter_dir", help="a DFlash drafter (e.g. models/tiny-code/drafter)")
    p.add_argument("out_dir")
    p.add_argument("--scale", type=float, default=0.003)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(f"[dflash2] {convert(a.drafter_dir, a.out_dir, scale=a.scale, seed=a.seed)}")


if __name__ == "__main__":
    main()
