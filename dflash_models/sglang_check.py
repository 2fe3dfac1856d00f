"""Check a drafter checkpoint against SGLang's own `DFlashDraftModel` (fp32, CPU).

    DFLASH_SERVE_CPU=1 python -m dflash_models.sglang_check TARGET_DIR DRAFTER_DIR [TARGET_DIR DRAFTER_DIR ...]

Loads the checkpoint through SGLang's `load_weights` and runs its modules the way the DFlash
worker does: `project_target_hidden` on the target features, `kv_proj_only` + `apply_k_norm` +
`apply_k_rope` for the context K/V, then `forward` on [anchor, mask...] with the target's
embedding. Only the attention kernel is a stand-in (RadixAttention needs a KV pool): non-causal
softmax attention over [context K/V ; block K/V], as SGLang's ENCODER_ONLY draft attention.
The same blocks go through `dflash_models.drafter_model.DFlashDrafter` (all blocks in one
masked forward, as in training). Prints one JSON line per pair: max abs difference of hidden
states and logits, and whether the greedy drafts agree. Needs `DFLASH_SERVE_CPU=1` (SGLang imports on CPU).
"""
from __future__ import annotations

import argparse
import json
import types
from pathlib import Path

import torch


class _ContextAttention(torch.nn.Module):
    """Stand-in for RadixAttention: attends the block to [context K/V ; its own K/V], non-causal."""

    def __init__(self, layer_id: int, nh: int, nkv: int, hd: int):
        super().__init__()
        self.layer_id, self.nh, self.nkv, self.hd = layer_id, nh, nkv, hd

    def forward(self, q, k, v, forward_batch, **_):
        t = q.shape[0]
        ck, cv = forward_batch.ctx_kv[self.layer_id]
        keys = torch.cat([ck, k.view(t, self.nkv, self.hd)]).repeat_interleave(self.nh // self.nkv, dim=1)
        vals = torch.cat([cv, v.view(t, self.nkv, self.hd)]).repeat_interleave(self.nh // self.nkv, dim=1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.view(t, self.nh, self.hd).transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1),
            scale=self.hd ** -0.5)
        return out.transpose(0, 1).reshape(t, -1)


def sglang_drafter(drafter_dir: Path):
    """SGLang's DFlashDraftModel with the checkpoint loaded by its own loader (tp 1, fp32)."""
    import torch
    from safetensors.torch import load_file
    from sglang.srt.runtime_context import get_parallel
    from transformers import AutoConfig

    get_parallel().override_permanently(tp_size=1, tp_rank=0,
                                        tp_group=types.SimpleNamespace(world_size=1, rank_in_group=0))
    from sglang.srt.models.dflash import DFlashDraftModel

    model = DFlashDraftModel(AutoConfig.from_pretrained(str(drafter_dir))).to(torch.float32).eval()
    model.load_weights(iter(load_file(str(drafter_dir / "model.safetensors")).items()))
    for i, layer in enumerate(model.layers):
        a = layer.self_attn
        a.attn = _ContextAttention(i, a.num_heads, a.num_kv_heads, a.head_dim)
    return model


def sglang_block(model, target_hidden, tokens, anchor: int, mask_id: int, embed):
    """One draft block exactly as the DFlash worker builds it; returns final hidden states [bs, H]."""
    import torch

    bs = model.block_size
    ctx = model.project_target_hidden(target_hidden[:anchor])
    fb = types.SimpleNamespace(ctx_kv=[])
    for layer in model.layers:
        a = layer.self_attn
        k, v = a.kv_proj_only(ctx)
        k = a.apply_k_rope(torch.arange(anchor), a.apply_k_norm(k))
        fb.ctx_kv.append((k.view(anchor, a.num_kv_heads, a.head_dim), v.view(anchor, a.num_kv_heads, a.head_dim)))
    ids = torch.full((bs,), mask_id)
    ids[0] = tokens[anchor]
    return model(ids, torch.arange(anchor, anchor + bs), fb, input_embeds=embed(ids)).hidden_states


def compare(target_dir: str | Path, drafter_dir: str | Path, anchors: list[int] | None = None,
            seq_len: int = 64, seed: int = 0) -> dict:
    import torch

    from dflash_models.drafter_model import DFlashDrafter
    from dflash_models.train_drafter import load_target, target_features
    from safetensors.torch import load_file

    target_dir, drafter_dir = Path(target_dir), Path(drafter_dir)
    cfg = json.loads((drafter_dir / "config.json").read_text())
    target = load_target(target_dir)
    ours = DFlashDrafter(cfg).eval()
    ours.load_state_dict({k: v.float() for k, v in load_file(str(drafter_dir / "model.safetensors")).items()})
    theirs = sglang_drafter(drafter_dir)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(4, cfg["vocab_size"], (1, seq_len), generator=g)
    anchors = anchors or [3, seq_len // 3, seq_len - cfg["block_size"] - 1]
    embed, head = target.get_input_embeddings(), target.get_output_embeddings().weight
    with torch.no_grad():
        feats = target_features(target, tokens, ours.target_layer_ids)
        mine = ours(feats, tokens, torch.tensor([anchors]), embed)[0]  # [N, bs, H]
        ref = torch.stack([sglang_block(theirs, feats[0], tokens[0], p, ours.mask_token_id, embed) for p in anchors])
    logits_m, logits_r = mine @ head.T, ref @ head.T
    return {"anchors": anchors, "hidden_max_abs_diff": (mine - ref).abs().max().item(),
            "hidden_max_abs": ref.abs().max().item(), "logits_max_abs_diff": (logits_m - logits_r).abs().max().item(),
            "greedy_drafts_equal": bool(torch.equal(logits_m[:, 1:].argmax(-1), logits_r[:, 1:].argmax(-1)))}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="+", metavar="TARGET_DIR DRAFTER_DIR", help="one or more pairs")
    p.add_argument("--anchors", type=int, nargs="*", default=None)
    a = p.parse_args(argv)
    if len(a.dirs) % 2:
        p.error("give TARGET_DIR DRAFTER_DIR pairs")
    from dflash_models.progress import single_thread

    single_thread(1)
    for target, drafter in zip(a.dirs[::2], a.dirs[1::2]):
        print(json.dumps({"target": target, "drafter": drafter, **compare(target, drafter, a.anchors)}), flush=True)


if __name__ == "__main__":
    main()
