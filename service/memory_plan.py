"""The memory plan of a GPU config, as `dflash-serve check` prints it: where one GPU's memory goes and how much
context and concurrency the KV pool then holds.

An estimate from the models' config.json and safetensors headers and the GPU's size (given, or read from
nvidia-smi), following SGLang's own accounting (`sglang/srt/mem_cache/kv_cache_configurator.py`,
`model_executor/model_runner_components/kv_pool_runtime.py`, `arg_groups/memory_hook.py`):

- SGLang's static budget is ``mem_fraction_static`` x the GPU's free memory at start-up (here: its size; the CUDA
  context and anything else on the GPU make it smaller). Weights (target and drafter) come out of it; the rest is
  the KV pool, in bytes per token of the target's full-attention layers plus the drafter's (DFlash's draft pool
  holds as many tokens as the target's).
- The verify CUDA graphs: with post-capture KV sizing (the launcher turns it on for ``dflash_adaptive`` on GPU)
  SGLang backs the KV pool after capture, so the graphs come out of the pool; without it they come out of the
  headroom left outside the static budget. Their size is modelled, not measured: one shared part (SGLang's float32
  logits buffer, ``max_bs`` x the start-up width rows, and one activation peak, since every graph shares SGLang's
  graph memory pool) and, per width, the hidden states its graphs return at its largest batch plus, for a width
  other than the start-up one, its own attention workspace (FlashInfer's, where that is the target's backend).
- Concurrency at a context length: the pool's tokens over (context + the verify block a request reserves).

Pure functions of their inputs (nothing imports torch or SGLang), so CI checks them on CPU with the GPU's size
given.
"""
from __future__ import annotations

import json
import math
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

from sglang_ext import names

GIB = 1 << 30
MIB = 1 << 20
# bytes per element of a dtype as config.json and safetensors headers name it
DTYPE_BYTES = {"float32": 4, "F32": 4, "float16": 2, "F16": 2, "bfloat16": 2, "BF16": 2, "float8_e4m3fn": 1,
               "F8_E4M3": 1, "float8_e5m2": 1, "F8_E5M2": 1, "int8": 1, "I8": 1, "U8": 1}
# SGLang's FlashInfer workspace (SGLANG_FLASHINFER_WORKSPACE_SIZE): every extra verify width builds its own
FLASHINFER_WORKSPACE = 384 * MIB
# context lengths the plan reports concurrency at, besides the model's own
CONTEXTS = (4096, 8192, 32768)


@dataclass(frozen=True)
class Shape:
    """What sizes a model's memory, from its config.json (a multimodal config's text_config)."""

    layers: int
    kv_layers: int  # layers that keep a full-attention KV cache
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    context: int
    captured_layers: int = 0  # a DFlash drafter: the target layers it reads (its fc input)

    @classmethod
    def of(cls, raw: dict) -> "Shape":
        cfg = raw.get("text_config", raw)
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        types = cfg.get("layer_types")
        dflash = raw.get("dflash_config") or {}
        # a DFlash drafter's sliding layers (z-lab's DFlash2 layout) keep a full KV too: SGLang builds no
        # sliding-window pool for its draft architectures (configs/model_config.py is_hybrid_swa_model)
        full = ("full_attention", "sliding_attention") if dflash else ("full_attention",)
        kv_layers = layers if not isinstance(types, list) else sum(t in full for t in types)
        return cls(layers=layers, kv_layers=kv_layers, hidden=hidden, heads=heads,
                   kv_heads=int(cfg.get("num_key_value_heads") or heads),
                   head_dim=int(cfg.get("head_dim") or hidden // heads), intermediate=int(cfg["intermediate_size"]),
                   vocab=int(cfg["vocab_size"]), tied=bool(raw.get("tie_word_embeddings", False)),
                   context=int(cfg.get("max_position_embeddings") or 0),
                   captured_layers=len(dflash.get("target_layer_ids") or ()))

    def layer_params(self) -> int:
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        out = self.heads * self.head_dim * self.hidden
        # + the SwiGLU MLP, two RMSNorms of the layer and the q / k norms of Qwen3
        return qkv + out + 3 * self.hidden * self.intermediate + 2 * self.hidden + 2 * self.head_dim

    def params(self) -> int:
        """Parameters as config.json describes them: a target's embedding and LM head; a DFlash drafter's fc and
        norms (it runs the target's embedding and LM head, and has none of its own)."""
        body = self.layers * self.layer_params() + self.hidden
        if self.captured_layers:
            return body + self.captured_layers * self.hidden * self.hidden + self.hidden
        return body + self.vocab * self.hidden * (1 if self.tied else 2)

    def kv_bytes_per_token(self, element: float, tp_size: int = 1) -> int:
        """K and V of every full-attention layer, on one of ``tp_size`` ranks (KV heads split, or replicated when
        there are fewer than ranks)."""
        return int(2 * self.kv_layers * math.ceil(self.kv_heads / tp_size) * self.head_dim * element)


def safetensors_params(directory: Path) -> int | None:
    """Parameters in the directory's safetensors files, from their headers (None: no safetensors there)."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for f in files:
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return total


def weights(directory: Path, shape: Shape, element: float) -> tuple[int, str]:
    """Bytes of a model's weights as served (``element`` bytes a parameter) and where the count comes from."""
    params = safetensors_params(directory)
    if params is not None:
        return int(params * element), "safetensors headers"
    return int(shape.params() * element), "estimate from config.json"


def sglang_max_bs(gpu_bytes: int, tp_size: int = 1) -> int:
    """SGLang's default largest decode CUDA-graph batch for a GPU of this size (``_handle_gpu_memory_settings``)."""
    mib = gpu_bytes / MIB
    if mib < 20 * 1024:
        return 8
    if mib < 35 * 1024:
        return 48 if tp_size < 4 else 160
    if mib < 60 * 1024:
        return 32 if tp_size < 4 else 160
    if mib < 160 * 1024:
        return 256 if tp_size < 4 else 512
    return 512


def sglang_mem_fraction(gpu_bytes: int, *, post_capture: bool, tp_size: int = 1, max_bs: int = 256,
                        chunked_prefill: int = 8192) -> float:
    """SGLang's default mem_fraction_static (``_handle_gpu_memory_settings``): the GPU less a reserve for
    activations and graphs, a small one when the pool is sized after capture."""
    mib = gpu_bytes / MIB
    if post_capture:
        reserved = 1536 + tp_size / 8 * 1024
    else:
        reserved = 512 + max(chunked_prefill, 2048) * 1.5 + tp_size / 8 * 1024 + max_bs * 2
        if mib > 60 * 1024:
            reserved = max(reserved, 10 * 1024)
    return round((mib - reserved) / mib, 3)


@dataclass(frozen=True)
class GraphEstimate:
    width: int
    batch: int  # its largest captured batch
    bytes: int


@dataclass(frozen=True)
class MemoryPlan:
    gpu_bytes: int
    gpu_source: str
    mem_fraction_static: float
    mem_fraction_source: str
    tp_size: int
    target_weights: int
    target_source: str
    drafter_weights: int
    drafter_source: str
    kv_bytes_per_token: int
    kv_detail: str
    max_bs: int
    shared_graph_bytes: int
    per_width: tuple[GraphEstimate, ...]
    post_capture: bool
    block: int  # KV slots a request reserves for its verify
    context: int  # the model's context length (model.context_length or its config's)
    max_total_tokens: int | None = None  # server.max_total_tokens

    @property
    def static_budget(self) -> int:
        return int(self.gpu_bytes * self.mem_fraction_static)

    @property
    def headroom(self) -> int:
        return self.gpu_bytes - self.static_budget

    @property
    def graph_bytes(self) -> int:
        return self.shared_graph_bytes + sum(g.bytes for g in self.per_width)

    @property
    def kv_pool_bytes(self) -> int:
        taken = self.target_weights + self.drafter_weights + (self.graph_bytes if self.post_capture else 0)
        return max(0, self.static_budget - taken)

    @property
    def kv_tokens(self) -> int:
        tokens = self.kv_pool_bytes // self.kv_bytes_per_token
        return tokens if self.max_total_tokens is None else min(tokens, self.max_total_tokens)

    def concurrency(self, context: int) -> int:
        """Requests of ``context`` tokens each that the KV pool holds at once."""
        return self.kv_tokens // (context + self.block)

    def contexts(self) -> list[int]:
        return sorted({c for c in CONTEXTS if not self.context or c < self.context} | ({self.context} - {0}),
                      reverse=True)

    def lines(self) -> list[str]:
        g = _gib
        out = [f"memory plan (estimate from the models' config.json and weights, not measured on a GPU), per GPU of "
               f"{g(self.gpu_bytes)} ({self.gpu_source})" + (f", tensor parallel {self.tp_size}" if self.tp_size > 1
                                                              else "") + ":",
               f"  static budget: mem_fraction_static {self.mem_fraction_static} ({self.mem_fraction_source}) x GPU = "
               f"{g(self.static_budget)}; {g(self.headroom)} left outside it for activations",
               f"  target weights {g(self.target_weights)} ({self.target_source})"
               + (f"; drafter weights {g(self.drafter_weights)} ({self.drafter_source})" if self.drafter_weights
                  else "")]
        widths = ", ".join(f"{w.width}: {g(w.bytes, 2)}" for w in self.per_width)
        where = ("taken from the KV pool (post-capture KV sizing)" if self.post_capture
                 else f"taken from the {g(self.headroom)} headroom (post-capture KV sizing off)")
        out.append(f"  verify CUDA graphs (estimate), batches up to {self.max_bs}: shared "
                   f"{g(self.shared_graph_bytes, 2)} (logits buffer, activations); per width {widths}; total "
                   f"{g(self.graph_bytes, 2)}, {where}")
        if self.kv_pool_bytes <= 0:
            out.append("  KV pool: nothing left: the weights" + (" and graphs" if self.post_capture else "")
                       + " exceed the static budget; raise sglang_args.mem_fraction_static, use a larger GPU or "
                         "sglang_args.tp_size")
            return out
        capped = " (server.max_total_tokens)" if self.max_total_tokens is not None and \
            self.max_total_tokens < self.kv_pool_bytes // self.kv_bytes_per_token else ""
        out.append(f"  KV pool {g(self.kv_pool_bytes)}: {self.kv_tokens:,} tokens{capped} at "
                   f"{self.kv_bytes_per_token:,} bytes a token ({self.kv_detail})")
        fits = ", ".join(f"{self.concurrency(c):,} at {c:,}" + (" (the model's context)" if c == self.context else "")
                         for c in self.contexts())
        out.append(f"  requests that fit at once, by context length in tokens: {fits}")
        if not self.post_capture and self.graph_bytes > self.headroom:
            out.append(f"  warning: the verify graphs ({g(self.graph_bytes)}) exceed the headroom; lower "
                       "sglang_args.mem_fraction_static or speculative.adaptive.candidates")
        return out


def _gib(n: float, digits: int = 1) -> str:
    return f"{n / GIB:.{digits}f} GiB"


def graph_estimates(target: Shape, *, widths: list[int], startup_width: int, max_bs: int, element: float,
                    captured_layers: int, flashinfer: bool) -> tuple[int, tuple[GraphEstimate, ...]]:
    """(shared bytes, per width) of the target's decode / verify CUDA graphs; see the module docstring."""
    logits_rows = max_bs * startup_width
    chain = [w for w in widths if w <= startup_width]
    peak_tokens = max_bs * max(chain or [startup_width])
    per_token = (2 * target.hidden + (target.heads + 2 * target.kv_heads) * target.head_dim
                 + target.heads * target.head_dim + 3 * target.intermediate)
    shared = logits_rows * target.vocab * 4 + int(peak_tokens * per_token * element)
    out = []
    for w in sorted(set(widths)):
        batch = max_bs if w <= startup_width else logits_rows // w  # a tree's graphs stop where its rows fit
        hidden_out = int(batch * w * (1 + captured_layers) * target.hidden * element)
        workspace = FLASHINFER_WORKSPACE if flashinfer and w != startup_width else 0
        out.append(GraphEstimate(w, batch, hidden_out + workspace))
    return shared, tuple(out)


def plan(target_dir: Path, target_raw: dict, drafter_dir: Path | None, drafter_raw: dict | None, *, gpu_bytes: int,
         gpu_source: str, dtype: str, widths: list[int], startup_width: int, sglang_args: dict,
         post_capture: bool, context: int | None = None, max_running_requests: int | None = None,
         max_total_tokens: int | None = None) -> MemoryPlan:
    """The memory plan of one GPU serving ``target`` (and ``drafter``) verifying ``widths`` (the start-up width:
    the drafter's block, or 1 without one). ``sglang_args``: the config's (mem_fraction_static, tp_size,
    kv_cache_dtype, cuda_graph_max_bs_decode, chunked_prefill_size, attention_backend are read)."""
    t = Shape.of(target_raw)
    d = Shape.of(drafter_raw) if drafter_raw is not None else None
    if dtype == "auto":
        dtype = str(target_raw.get("dtype") or target_raw.get("torch_dtype") or "bfloat16")
    element = DTYPE_BYTES.get(dtype, 2)
    kv_dtype = str(sglang_args.get("kv_cache_dtype") or "auto")
    kv_element = 1 if kv_dtype.startswith("fp8") else 0.5 if kv_dtype.startswith("fp4") else element
    from service.sglang_args import number  # (imports pydantic: only where a plan is made)

    tp = number(sglang_args, "tp_size", 1, minimum=1)
    max_bs = number(sglang_args, "cuda_graph_max_bs_decode", sglang_max_bs(gpu_bytes, tp), minimum=1)
    if max_running_requests is not None and "cuda_graph_max_bs_decode" not in sglang_args:
        max_bs = min(max_bs, max_running_requests)  # as SGLang caps its default
    if sglang_args.get("mem_fraction_static") is not None:
        fraction = number(sglang_args, "mem_fraction_static", 0, kind=float)
        fraction_source = "sglang_args.mem_fraction_static"
    else:
        fraction = sglang_mem_fraction(gpu_bytes, post_capture=post_capture, tp_size=tp, max_bs=max_bs,
                                       chunked_prefill=number(sglang_args, "chunked_prefill_size", 8192))
        fraction_source = "SGLang's default for this GPU"
    target_weights, target_source = weights(target_dir, t, element)
    drafter_weights, drafter_source = (0, "") if d is None or drafter_dir is None else weights(drafter_dir, d, element)
    per_token = t.kv_bytes_per_token(kv_element, tp) + (d.kv_bytes_per_token(kv_element, tp) if d else 0)
    detail = f"target {t.kv_layers} layers x {t.kv_heads} KV heads x {t.head_dim}"
    if d is not None:
        detail += f", drafter {d.kv_layers} layers x {d.kv_heads} x {d.head_dim}"
    detail += f", {dtype if kv_dtype == 'auto' else kv_dtype}"
    shared, per_width = graph_estimates(t, widths=widths, startup_width=startup_width, max_bs=max_bs, element=element,
                                        captured_layers=d.captured_layers if d else 0,
                                        flashinfer=sglang_args.get("attention_backend") == "flashinfer")
    return MemoryPlan(gpu_bytes=gpu_bytes, gpu_source=gpu_source, mem_fraction_static=fraction,
                      mem_fraction_source=fraction_source, tp_size=tp, target_weights=target_weights // tp,
                      target_source=target_source, drafter_weights=drafter_weights // tp,
                      drafter_source=drafter_source, kv_bytes_per_token=per_token, kv_detail=detail,
                      max_bs=max_bs, shared_graph_bytes=shared, per_width=per_width, post_capture=post_capture,
                      block=startup_width, context=context or t.context, max_total_tokens=max_total_tokens)


def detect_gpu_bytes(run=subprocess.run) -> tuple[int, str] | None:
    """The smallest GPU's memory as nvidia-smi reports it, and a note saying so (None: no nvidia-smi answer)."""
    if shutil.which("nvidia-smi") is None and run is subprocess.run:
        return None
    try:
        out = run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"], capture_output=True,
                  text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    sizes = [int(x) for x in out.stdout.split() if x.strip().isdigit()] if out.returncode == 0 else []
    if not sizes:
        return None
    return min(sizes) * MIB, f"nvidia-smi, the smallest of {len(sizes)} GPU{'s' if len(sizes) > 1 else ''}"


def for_config(config, report, *, gpu_bytes: int, gpu_source: str, env: dict[str, str]) -> MemoryPlan:
    """The plan of a loaded GPU config (``config``: a ServeConfig; ``report``: its preflight report; ``env``: the
    server's environment, which says whether SGLang sizes the KV pool after capture)."""
    spec = config.speculative
    if spec.algorithm == "dflash_adaptive":
        startup = report.draft_block_size
        widths = list(spec.adaptive_settings().controller.candidates_for(startup))
    elif spec.algorithm == "dflash":
        startup = report.block_size
        widths = [startup]
    else:
        startup, widths = 1, [1]
    drafter_dir = spec.draft_model_path if spec.algorithm != "none" else None
    return plan(config.model.path, _raw(config.model.path), drafter_dir,
                _raw(drafter_dir) if drafter_dir is not None else None, gpu_bytes=gpu_bytes, gpu_source=gpu_source,
                dtype=config.model.dtype, widths=widths, startup_width=startup, sglang_args=config.sglang_args,
                post_capture=env.get(names.SGLANG_POST_CAPTURE_KV_SIZING, "").lower() in ("1", "true", "yes", "on"),
                context=config.model.context_length, max_running_requests=config.server.max_running_requests,
                max_total_tokens=config.server.max_total_tokens)


def _raw(directory: Path) -> dict:
    return json.loads((directory / "config.json").read_text())
