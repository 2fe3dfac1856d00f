"""What a verify forward of Qwen3-8B's shape costs on this GPU, per batch size and verify width: the target's share
of a DFlash step, measured, next to the roofline the controller seeds its GPU cost table with
(sglang_ext/controller/profiles/h200_qwen3_8b.json, roofline.py ``target_time`` less its fixed overhead).

Why: the packaged GPU seed is a model ("modelling assumptions, not measurements"), and whether a DDTree of 63
prefixes (a 64-token verify per request) can pay where a chain of 16 does depends on how much more the wider verify
costs. This measures the forward the width changes, on the hardware, without the serving stack (no SGLang here):
a gpt-fast-style decoder of Qwen3-8B's shape -- 36 layers, hidden 4096, 32 query / 8 KV heads of 128 (q/k norms,
rotary), SwiGLU 12288, the 151,936-token LM head on every verify token as a verify computes it -- with random
bfloat16 weights (a forward's time does not depend on their values), each request holding ``--context`` tokens of
KV (the seed's 1024). The verify's w tokens attend to the prefix and causally within the block (a tree's ancestor
mask costs the same in this kernel). Also timed: the DFlash drafter's forward (5 layers of the same shape over the
16-token block, non-causal, the LM head on its 15 draft positions). Every point is one CUDA graph, replayed
``--repeats`` times after a warm-up: CUDA-event median.

    python3 benchmarks/gpu_forward_cost.py [--batches 1 8 32 64] [--widths 1 2 4 8 16 32 64] [--out FILE]
    python3 benchmarks/gpu_forward_cost.py --tiny --device cpu     # a smoke run of the code path, any machine
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.tree_cost import captured  # noqa: E402
from sglang_ext.controller.roofline import RooflineProfile, load_json  # noqa: E402

PROFILE = REPO / "sglang_ext/controller/profiles/h200_qwen3_8b.json"


@dataclass(frozen=True)
class Shape:
    layers: int = 36
    hidden: int = 4096
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    ffn: int = 12288
    vocab: int = 151936
    draft_layers: int = 5
    block: int = 16


TINY = Shape(layers=2, hidden=64, q_heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=1000, draft_layers=1)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype) * w


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


class Decoder:
    """``layers`` decoder layers of ``shape`` with their own random weights and KV caches ([bs, kv, ctx + w, d])."""

    def __init__(self, shape: Shape, layers: int, bs: int, ctx: int, w: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        s, g = shape, torch.Generator(device=device).manual_seed(0)

        def rnd(*size: int) -> torch.Tensor:
            return torch.empty(size, device=device, dtype=dtype).normal_(0, 0.02, generator=g)

        qkv = (s.q_heads + 2 * s.kv_heads) * s.head_dim
        self.s, self.bs, self.ctx, self.w = s, bs, ctx, w
        self.layers = [dict(wqkv=rnd(s.hidden, qkv), wo=rnd(s.q_heads * s.head_dim, s.hidden),
                            w13=rnd(s.hidden, 2 * s.ffn), w2=rnd(s.ffn, s.hidden),
                            n1=torch.ones(s.hidden, device=device, dtype=dtype),
                            n2=torch.ones(s.hidden, device=device, dtype=dtype),
                            qn=torch.ones(s.head_dim, device=device, dtype=dtype),
                            kn=torch.ones(s.head_dim, device=device, dtype=dtype),
                            k=rnd(bs, s.kv_heads, ctx + w, s.head_dim), v=rnd(bs, s.kv_heads, ctx + w, s.head_dim))
                       for _ in range(layers)]
        pos = torch.arange(ctx, ctx + w, device=device, dtype=torch.float32)
        inv = 1.0 / (1e6 ** (torch.arange(0, s.head_dim // 2, device=device, dtype=torch.float32) / (s.head_dim // 2)))
        ang = pos[:, None] * inv[None, :]  # [w, d/2]
        self.cos, self.sin = ang.cos().to(dtype), ang.sin().to(dtype)
        self.slots = torch.arange(ctx, ctx + w, device=device)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [bs * w, hidden]; mask [1 or bs, 1, groups * w, ctx + w] bool (True: attend)."""
        s, bs, w = self.s, self.bs, self.w
        groups = s.q_heads // s.kv_heads
        for p in self.layers:
            h = rms(x, p["n1"])
            q, k, v = (h @ p["wqkv"]).split([s.q_heads * s.head_dim, s.kv_heads * s.head_dim,
                                              s.kv_heads * s.head_dim], dim=-1)
            q = rope(rms(q.view(bs, w, s.q_heads, s.head_dim), p["qn"]), self.cos[:, None], self.sin[:, None])
            k = rope(rms(k.view(bs, w, s.kv_heads, s.head_dim), p["kn"]), self.cos[:, None], self.sin[:, None])
            p["k"].index_copy_(2, self.slots, k.transpose(1, 2))
            p["v"].index_copy_(2, self.slots, v.view(bs, w, s.kv_heads, s.head_dim).transpose(1, 2))
            # grouped-query attention without copying K/V: each KV head's query heads ride along the query axis
            qg = q.view(bs, w, s.kv_heads, groups, s.head_dim).permute(0, 2, 3, 1, 4).reshape(
                bs, s.kv_heads, groups * w, s.head_dim)
            o = F.scaled_dot_product_attention(qg, p["k"], p["v"], attn_mask=mask)
            o = o.view(bs, s.kv_heads, groups, w, s.head_dim).permute(0, 3, 1, 2, 4).reshape(bs * w, -1)
            x = x + o @ p["wo"]
            a, b = (rms(x, p["n2"]) @ p["w13"]).chunk(2, dim=-1)
            x = x + (F.silu(a) * b) @ p["w2"]
        return x


def block_mask(bs: int, w: int, ctx: int, groups: int, causal: bool, device: torch.device) -> torch.Tensor:
    cols = torch.arange(ctx + w, device=device)
    rows = torch.arange(w, device=device)
    m = (cols[None, :] < ctx) | (cols[None, :] - ctx <= rows[:, None]) if causal else \
        torch.ones(w, ctx + w, dtype=torch.bool, device=device)
    return m.repeat(groups, 1).view(1, 1, groups * w, ctx + w)  # rows group-major, as Decoder.forward lays q out


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median ms of ``fn``: one CUDA graph replayed (CUDA events), or plain calls on CPU."""
    if device.type != "cuda":
        fn()
        out = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
        return statistics.median(out)
    graph, _ = captured(fn)
    out = []
    for _ in range(repeats + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    del graph
    return statistics.median(out[2:])


def measure(shape: Shape, bs: int, w: int, ctx: int, repeats: int, device: torch.device, dtype: torch.dtype,
            draft: bool) -> float:
    """ms of one target verify forward of ``w`` tokens per request (``draft``: the drafter's block forward)."""
    s = shape
    layers = s.draft_layers if draft else s.layers
    dec = Decoder(s, layers, bs, ctx, w, device, dtype)
    embed = torch.empty(s.vocab, s.hidden, device=device, dtype=dtype).normal_(0, 0.02)
    head = torch.empty(s.hidden, s.vocab, device=device, dtype=dtype).normal_(0, 0.02)
    tokens = torch.randint(0, s.vocab, (bs * w,), device=device)
    mask = block_mask(bs, w, ctx, s.q_heads // s.kv_heads, causal=not draft, device=device)
    final = torch.ones(s.hidden, device=device, dtype=dtype)
    lm_rows = torch.arange(bs * w, device=device).view(bs, w)[:, 1:].reshape(-1) if draft else None

    def step() -> torch.Tensor:
        h = rms(dec.forward(embed[tokens], mask), final)
        if lm_rows is not None:  # the drafter runs the target's LM head on its draft positions only
            h = h.index_select(0, lm_rows)
        return (h @ head).argmax(dim=-1)

    with torch.inference_mode():
        ms = timed(step, repeats, device)
    del dec, embed, head
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ms


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--context", type=int, default=1024, help="KV tokens per request before the step")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny model: checks the code path, measures nothing")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/gpu_forward_cost.json")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    shape = TINY if a.tiny else Shape()
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    roof = RooflineProfile.from_dict(load_json(PROFILE))
    rows = []
    print("| requests | width | target verify ms | roofline ms | measured / roofline | x width 16 | draft ms |\n"
          "|---:|---:|---:|---:|---:|---:|---:|")
    for bs in a.batches:
        draft_ms = measure(shape, bs, shape.block, a.context, a.repeats, device, dtype, draft=True)
        got = {w: measure(shape, bs, w, a.context, a.repeats, device, dtype, draft=False) for w in a.widths}
        for w, ms in got.items():
            model = (roof.target_time(bs, w, bs * a.context) - roof.t_overhead) * 1e3
            r = {"requests": bs, "width": w, "target_ms": ms, "roofline_ms": model,
                 "measured_over_roofline": ms / model, "over_width16": ms / got[16] if 16 in got else None,
                 "draft_ms": draft_ms}
            rows.append(r)
            x16 = f"{r['over_width16']:.2f}" if r["over_width16"] is not None else "-"
            print(f"| {bs} | {w} | {ms:.2f} | {model:.2f} | {ms / model:.2f} | {x16} | {draft_ms:.2f} |", flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "shape": shape.__dict__, "context": a.context, "repeats": a.repeats, "dtype": str(dtype), "rows": rows},
        indent=1) + "\n")
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
