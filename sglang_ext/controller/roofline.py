"""Roofline step-time model of one DFlash decode step, from a JSON hardware/model profile.

Why: two users need the same physics: the simulator (ground truth of its virtual GPU) and ``CostModel`` (a seed
table for a server that has not profiled yet). Keeping it here means one place to change when the model changes.

A step = [draft forward over the full trained block, when drafting] + target verify forward over b tokens per
request + fixed overheads. Each forward costs ``smooth_max(bytes / bandwidth, flops / peak)``, with achieved
fractions of peak (``bw_efficiency``, ``flops_efficiency``) and a p-norm smooth maximum so the memory/compute knee
is gradual (real kernels reach neither roof near the ridge). Bytes = weights + KV read for every context token of
every request; flops = 2 * matmul params per token + attention (4 * layers * q_heads * head_dim per query/context
token pair). The DFlash drafter has no LM head of its own: it runs the target's on the B_max - 1 draft positions.

Profile schema (all SI units; see profiles/h200_qwen3_8b.json):
  hardware: {hbm_bandwidth_Bps, peak_flops, bw_efficiency, flops_efficiency, roofline_smoothness}
  target:   {weights_bytes, matmul_params, kv_bytes_per_token, n_layers, q_heads, head_dim, step_overhead_s}
  draft:    {weights_bytes, matmul_params, lm_head_bytes, lm_head_params, kv_bytes_per_token, n_layers,
             q_heads, head_dim, block, step_overhead_s, context_update_bytes}
  spec_overhead_s: extra per-step cost of a speculative verify (b > 1): accept kernel, bookkeeping.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def load_json(path_or_dict: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """A profile given as a path or already-parsed mapping."""
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict)
    with open(path_or_dict, encoding="utf-8") as f:
        return json.load(f)


def _need(d: Mapping[str, Any], section: str, key: str) -> float:
    try:
        v = float(d[key])
    except KeyError:
        raise ValueError(f"{section}.{key}: missing from profile") from None
    except (TypeError, ValueError):
        raise ValueError(f"{section}.{key}: must be a number, got {d[key]!r}") from None
    if v < 0:
        raise ValueError(f"{section}.{key}: must be >= 0, got {v}")
    return v


@dataclass(frozen=True)
class RooflineProfile:
    """Parsed roofline profile; ``step_time`` is the model."""

    name: str
    bw: float
    flops: float
    smooth: float
    t_weights: float
    t_params: float
    t_kv: float
    t_attn: float
    t_overhead: float
    d_weights: float
    d_params: float
    d_lm_bytes: float
    d_lm_params: float
    d_kv: float
    d_attn: float
    d_block: int
    d_overhead: float
    d_ctx_bytes: float
    spec_overhead: float

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RooflineProfile":
        """Parse and validate; errors name ``section.key``."""
        for section in ("hardware", "target", "draft"):
            if not isinstance(d.get(section), Mapping):
                raise ValueError(f"{section}: missing section in roofline profile")
        h, t, dr = d["hardware"], d["target"], d["draft"]
        smooth = _need(h, "hardware", "roofline_smoothness")
        if smooth < 1:
            raise ValueError(f"hardware.roofline_smoothness: must be >= 1, got {smooth}")
        bw = _need(h, "hardware", "hbm_bandwidth_Bps") * _need(h, "hardware", "bw_efficiency")
        fl = _need(h, "hardware", "peak_flops") * _need(h, "hardware", "flops_efficiency")
        if bw <= 0 or fl <= 0:
            raise ValueError("hardware: bandwidth and flops (times efficiency) must be > 0")
        block = int(_need(dr, "draft", "block"))
        if block < 2:
            raise ValueError(f"draft.block: must be >= 2, got {block}")

        def attn(sec: Mapping[str, Any], name: str) -> float:
            return 4.0 * _need(sec, name, "n_layers") * _need(sec, name, "q_heads") * _need(sec, name, "head_dim")

        return cls(
            name=str(d.get("name", "roofline")),
            bw=bw,
            flops=fl,
            smooth=smooth,
            t_weights=_need(t, "target", "weights_bytes"),
            t_params=_need(t, "target", "matmul_params"),
            t_kv=_need(t, "target", "kv_bytes_per_token"),
            t_attn=attn(t, "target"),
            t_overhead=_need(t, "target", "step_overhead_s"),
            d_weights=_need(dr, "draft", "weights_bytes"),
            d_params=_need(dr, "draft", "matmul_params"),
            d_lm_bytes=_need(dr, "draft", "lm_head_bytes"),
            d_lm_params=_need(dr, "draft", "lm_head_params"),
            d_kv=_need(dr, "draft", "kv_bytes_per_token"),
            d_attn=attn(dr, "draft"),
            d_block=block,
            d_overhead=_need(dr, "draft", "step_overhead_s"),
            d_ctx_bytes=_need(dr, "draft", "context_update_bytes"),
            spec_overhead=float(d.get("spec_overhead_s", 0.0)),
        )

    def _roof(self, nbytes: float, nflops: float) -> float:
        m = nbytes / self.bw
        c = nflops / self.flops
        p = self.smooth
        hi = max(m, c)
        if hi <= 0.0:
            return 0.0
        return hi * ((m / hi) ** p + (c / hi) ** p) ** (1.0 / p)

    def target_time(self, batch: int, block: int, context_tokens: float) -> float:
        """Target verify forward: ``batch`` requests x ``block`` tokens over ``context_tokens`` KV in total."""
        q = batch * block
        nbytes = self.t_weights + (context_tokens + q) * self.t_kv
        nflops = 2.0 * self.t_params * q + self.t_attn * block * (context_tokens + 0.5 * q)
        return self._roof(nbytes, nflops) + self.t_overhead

    def draft_time(self, batch: int, context_tokens: float) -> float:
        """Draft forward over the full trained block (anchor + B_max - 1 masks), LM head on the draft positions."""
        q = batch * self.d_block
        nbytes = self.d_weights + self.d_lm_bytes + (context_tokens + q) * self.d_kv
        nflops = (
            2.0 * self.d_params * q
            + 2.0 * self.d_lm_params * batch * (self.d_block - 1)
            + self.d_attn * self.d_block * (context_tokens + 0.5 * q)
        )
        return self._roof(nbytes, nflops) + self.d_overhead

    def context_update_time(self) -> float:
        """Keeping the draft context KV current (runs every step, even at b = 1)."""
        return self.d_ctx_bytes / self.bw

    def step_time(self, batch: int, block: int, context_tokens: float, drafted: bool | None = None) -> float:
        """Seconds for one decode step; ``drafted`` defaults to ``block > 1`` (b = 1 skips the draft)."""
        if batch <= 0:
            return 0.0
        if drafted is None:
            drafted = block > 1
        t = self.target_time(batch, block, context_tokens) + self.context_update_time()
        if drafted:
            t += self.draft_time(batch, context_tokens)
        if block > 1:
            t += self.spec_overhead
        return t
