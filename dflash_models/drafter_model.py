"""Training-time DFlash drafter in plain torch, computing what SGLang's `DFlashDraftModel` computes.

Inference (SGLang `srt/models/dflash.py` + `srt/speculative/dflash_worker_v2.py`), per request:

- context: the target's hidden states after layers `target_layer_ids` (HF `hidden_states[L + 1]`)
  of every committed token, concatenated -> `fc` -> `hidden_norm` = ctx; each draft layer writes
  K = rope(k_norm(k_proj(ctx))) and V = v_proj(ctx) into its KV cache (no input layernorm);
- block: [anchor (the bonus token), mask x (B-1)] at positions p..p+B-1, embedded with the
  target's (frozen) embedding; pre-norm Qwen3 layers whose attention is NON-causal over
  [context KV of positions < p ; the block's own KV];
- proposals: the final `norm`, then the target's LM head, at block positions 1..B-1.

`DFlashDrafter.forward` does this for many blocks of one sequence at once (random anchors),
with a boolean mask giving each block its own context prefix and bidirectional attention inside
itself; blocks never see each other. Parameter names are z-lab's, so `state_dict()` is the
checkpoint SGLang loads (`save_drafter`).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.to(dtype) * self.weight


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary tables for `positions` (any shape) -> [..., head_dim]."""
    half = torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device)
    inv_freq = 1.0 / (theta ** (half / head_dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, heads, d]; cos/sin [..., T, d]."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(-2) + rot * sin.unsqueeze(-2)


class Attention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h = cfg["hidden_size"]
        self.nh, self.nkv, self.hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        self.theta = float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0)
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=False)
        self.q_norm = RMSNorm(self.hd, eps)
        self.k_norm = RMSNorm(self.hd, eps)

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor):
        """K/V the worker materialises for committed tokens: [B, S, nkv, hd] each."""
        k = self.k_norm(self.k_proj(ctx).unflatten(-1, (self.nkv, self.hd)))
        cos, sin = rope_cos_sin(positions, self.hd, self.theta)
        return apply_rope(k, cos, sin), self.v_proj(ctx).unflatten(-1, (self.nkv, self.hd))

    def forward(self, x, positions, ctx_k, ctx_v, mask):
        """x [B, T, H] block tokens; ctx_k/v [B, S, nkv, hd]; mask [B, T, S + T] (True = attend)."""
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.nh, self.hd)))
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.nkv, self.hd)))
        v = self.v_proj(x).unflatten(-1, (self.nkv, self.hd))
        cos, sin = rope_cos_sin(positions, self.hd, self.theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        k = torch.cat([ctx_k, k], dim=1).transpose(1, 2)  # [B, nkv, S+T, hd]
        v = torch.cat([ctx_v, v], dim=1).transpose(1, 2)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask.unsqueeze(1),
                                             scale=self.hd ** -0.5)
        return self.o_proj(out.transpose(1, 2).flatten(-2))


class MLP(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        h, i = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.input_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], eps)
        self.mlp = MLP(cfg)

    def forward(self, x, positions, ctx_k, ctx_v, mask):
        x = x + self.self_attn(self.input_layernorm(x), positions, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """The drafter's own weights (z-lab names). Embedding and LM head are the target's, passed in."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg = cfg
        h = cfg["hidden_size"]
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        dflash = cfg["dflash_config"]
        # where SGLang's loader looks first (z-lab's DFlash2 configs set it only there), then the top level (b16)
        self.block_size = int(dflash.get("block_size", cfg.get("block_size")))
        self.target_layer_ids = list(dflash["target_layer_ids"])
        self.mask_token_id = int(dflash["mask_token_id"])
        self.layers = nn.ModuleList([Layer(cfg) for _ in range(cfg["num_hidden_layers"])])
        self.norm = RMSNorm(h, eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, eps)

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
                    if name.endswith(("o_proj.weight", "down_proj.weight")):  # residual branches
                        p.mul_(1 / math.sqrt(2 * len(self.layers)))

    def block_inputs(self, tokens: torch.Tensor, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Block token ids [B, N*bs] (anchor token, then masks) and their positions."""
        bs = self.block_size
        offs = torch.arange(bs, device=anchors.device)
        positions = (anchors[..., None] + offs).flatten(1)
        ids = torch.full_like(positions, self.mask_token_id)
        ids.view(*anchors.shape, bs)[..., 0] = tokens.gather(1, anchors)
        return ids, positions

    def attention_mask(self, anchors: torch.Tensor, seq_len: int) -> torch.Tensor:
        """[B, N*bs, S + N*bs]: block n sees context positions < anchor_n and all of block n."""
        bs = self.block_size
        B, N = anchors.shape
        ctx = torch.arange(seq_len, device=anchors.device)[None, None, :] < anchors[..., None]  # [B, N, S]
        ctx = ctx.repeat_interleave(bs, dim=1)  # [B, N*bs, S]
        blk = torch.arange(N * bs, device=anchors.device) // bs
        own = (blk[:, None] == blk[None, :]).expand(B, -1, -1)
        return torch.cat([ctx, own], dim=-1)

    def forward(self, target_hidden: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                embed: nn.Module) -> torch.Tensor:
        """Final hidden states of every block position, [B, N, bs, H].

        target_hidden [B, S, K*H]: concatenated target features of every token of the sequence;
        tokens [B, S]; anchors [B, N] block starts (context = positions < anchor)."""
        B, S = tokens.shape
        ctx = self.hidden_norm(self.fc(target_hidden))
        ctx_pos = torch.arange(S, device=tokens.device).expand(B, S)
        ids, positions = self.block_inputs(tokens, anchors)
        mask = self.attention_mask(anchors, S)
        x = embed(ids)
        for layer in self.layers:
            ctx_k, ctx_v = layer.self_attn.context_kv(ctx, ctx_pos)
            x = layer(x, positions, ctx_k, ctx_v, mask)
        return self.norm(x).view(B, anchors.shape[1], self.block_size, -1)


def position_weights(block_size: int, gamma: float) -> torch.Tensor:
    """Loss weight per block position: 0 for the anchor (position 0, given), exp(-(k-1)/gamma) for k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def block_labels(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int,
                 valid_end: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels [B, N, bs] (token at anchor + k) and a validity mask (inside the sequence, before
    `valid_end` [B] if given)."""
    B, S = tokens.shape
    pos = anchors[..., None] + torch.arange(block_size, device=anchors.device)
    end = torch.full((B,), S, device=tokens.device) if valid_end is None else valid_end
    valid = pos < end[:, None, None]
    labels = tokens.gather(1, pos.clamp(max=S - 1).flatten(1)).view_as(pos)
    return labels, valid


def dflash_loss(hidden: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, lm_head_weight: torch.Tensor,
                gamma: float) -> tuple[torch.Tensor, dict]:
    """Position-weighted CE over block positions 1..bs-1, normalised by the weights used."""
    bs = hidden.shape[2]
    w = position_weights(bs, gamma).to(hidden.device)[None, None, :] * valid.float()
    sel = w > 0
    logits = hidden[sel] @ lm_head_weight.T
    ce = F.cross_entropy(logits.float(), labels[sel], reduction="none")
    loss = (ce * w[sel]).sum() / w[sel].sum().clamp_min(1e-9)
    with torch.no_grad():
        hit = torch.zeros_like(w, dtype=torch.bool)
        hit[sel] = logits.argmax(-1) == labels[sel]
        # accepted length per block if drafted greedily: 1 (the anchor) + leading run of hits
        run = torch.cumprod((hit | ~valid)[..., 1:].int() & valid[..., 1:].int(), dim=-1).sum(-1)
        stats = {"acc1": hit[..., 1][valid[..., 1]].float().mean().item(), "tau": 1.0 + run.float().mean().item()}
    return loss, stats
