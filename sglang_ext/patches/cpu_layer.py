"""Patches of SGLang 0.5.23 call sites for serving on CPU (only when the CPU layer is active).

Each patch names the call site it serves and why; the pure-torch code they bind lives in `sglang_ext/cpu/`.
Patches that touch SGLang modules are deferred with `when_imported`, so register() imports nothing heavy.
`install()` is idempotent and returns the patch names.
"""
from __future__ import annotations

import logging
from types import ModuleType

from sglang_ext.patches.wrap import when_imported, wrap

logger = logging.getLogger(__name__)
_applied: list[str] = []


def install() -> list[str]:
    if not _applied:
        for patch in _PATCHES:
            patch()
            _applied.append(patch.__name__.lstrip("_"))
    return list(_applied)


# -- server args ------------------------------------------------------------------------

class _CpuDFlashPlatformView:
    """The in-tree CPU platform, answering DFlash questions as an out-of-tree platform would.

    arg_groups/speculative_hook.py `_handle_dflash` rejects every device but cuda/npu/xpu for
    in-tree platforms, and `_resolve_dflash_draft_attention_backend` falls back to flashinfer;
    for out-of-tree platforms both ask the platform. Everything else passes through.
    """

    DRAFT_BACKEND = "torch_native"

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def is_out_of_tree(self) -> bool:
        return True

    def supports_speculative_algorithm(self, algorithm) -> bool:
        return str(algorithm).upper().startswith("DFLASH")

    def supports_speculative_draft_attention_backend(self, algorithm, backend) -> bool:
        return backend == self.DRAFT_BACKEND

    def get_default_speculative_draft_attention_backend(self, algorithm) -> str:
        return self.DRAFT_BACKEND


def handle_dflash_on_cpu(server_args) -> None:
    """Run upstream `_handle_dflash` (steps, topk, block size, draft backend, max running
    requests) with the CPU platform view; used for builtin DFLASH and by our own algorithms."""
    from sglang.srt.arg_groups import speculative_hook as sh

    original = getattr(sh._handle_dflash, "__wrapped__", sh._handle_dflash)
    real = sh.current_platform
    sh.current_platform = _CpuDFlashPlatformView(real)  # arg parsing is single-threaded
    try:
        original(server_args)
    finally:
        sh.current_platform = real


def _builtin_dflash_on_cpu() -> None:
    def make(original):
        def _handle_dflash(server_args):
            if getattr(server_args, "device", None) != "cpu":
                return original(server_args)
            return handle_dflash_on_cpu(server_args)

        return _handle_dflash

    def patch(sh: ModuleType) -> None:
        wrap(sh, "_handle_dflash", make)  # spec_info.handle_server_args imports it at call time

    when_imported("sglang.srt.arg_groups.speculative_hook", patch)


def _torch_native_draft_backend() -> None:
    """speculative/draft_worker_common.py `resolve_draft_worker_attention_backend` falls back
    to flashinfer for backends outside DRAFT_ATTENTION_BACKEND_CHOICES; choices.py exports
    `add_draft_attention_backend_choices` for exactly this."""

    def patch(choices: ModuleType) -> None:
        if "torch_native" not in choices.DRAFT_ATTENTION_BACKEND_CHOICES:
            choices.add_draft_attention_backend_choices(["torch_native"])

    when_imported("sglang.srt.arg_groups.choices", patch)


# -- tensors, models, runner ------------------------------------------------------------

def _record_stream_cpu_noop() -> None:
    """speculative/dflash_worker_v2.py calls `seq_lens.record_stream(current_stream())`
    unconditionally; on CPU that is a torch.cpu.Stream and torch raises. CPU tensors need no
    cross-stream lifetime tracking."""
    import torch

    def make(original):
        def record_stream(self, stream):
            if self.device.type == "cpu":
                return None
            return original(self, stream)

        return record_stream

    wrap(torch.Tensor, "record_stream", make)


def _dflash_draft_torch_qk_norm_rope() -> None:
    """models/dflash.py `DFlashAttention.forward` takes the Triton `table_qk_norm_rope_` kernel
    for bf16 when `use_table_qk_norm_rope`; its else-branch (apply_qk_norm + rotary_emb) is
    the same math in torch."""

    def make(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            self.use_table_qk_norm_rope = False

        return __init__

    def patch(dflash: ModuleType) -> None:
        wrap(dflash.DFlashAttention, "__init__", make)

    when_imported("sglang.srt.models.dflash", patch)


def _input_embeds_in_runner_dtype() -> None:
    """model_executor/model_runner.py `_extend_forward_kwargs` casts input_embeds with
    `.bfloat16()` on every device, so the DFlash draft (fed input embeds) breaks under
    `--dtype float32`. Cast to the runner's dtype instead (identical for bf16 models)."""

    def make(original):
        def _extend_forward_kwargs(self, forward_batch, *args, **kwargs):
            out = original(self, forward_batch, *args, **kwargs)
            embeds = out.get("input_embeds")
            if embeds is not None and forward_batch.input_embeds is not None and embeds.dtype != self.dtype:
                out["input_embeds"] = forward_batch.input_embeds.to(self.dtype)
            return out

        return _extend_forward_kwargs

    def patch(mr: ModuleType) -> None:
        wrap(mr.ModelRunner, "_extend_forward_kwargs", make)

    when_imported("sglang.srt.model_executor.model_runner", patch)


# -- attention and sampling -------------------------------------------------------------

# the spec-info attribute of a ragged TARGET_VERIFY (cpu/attention.py RaggedBlock); the adaptive worker sets it
RAGGED_ATTR = "_dflash_serve_ragged"

def _torch_native_block_attention() -> None:
    """layers/attention/torch_native_backend.py: TARGET_VERIFY (target verify, causal; DFlash
    draft, ENCODER_ONLY = non-causal) has no path upstream, and DECODE loops per request.
    Both become one batched O(L*n) SDPA per layer (cpu/attention.py). The gather index and
    mask are built once per forward batch and shared by all its layers. A tree verify (the
    adaptive worker's DDTree step) replaces causal with its ancestor mask; a ragged step (the
    adaptive worker's per-request widths) sets RAGGED_ATTR on the forward's spec info."""

    def tree_mask(fb, block: int):
        """A tree verify's ancestor mask over the verified block, [bs, block, block]: DFlashVerifyInput.custom_mask
        ("True means the (q, k) pair is allowed"), which the adaptive worker's tree step sets in the layout GPU
        attention reads (tree/mask.py packed; upstream's own chain verify leaves it None)."""
        from sglang_ext.tree.mask import unpacked

        mask = getattr(fb.spec_info, "custom_mask", None) if fb.forward_mode.is_target_verify() else None
        return None if mask is None else unpacked(mask, fb.seq_lens, block)

    def patch(tnb: ModuleType) -> None:
        cls = tnb.TorchNativeAttnBackend
        from sglang.srt.layers.radix_attention import AttentionType
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc

        from sglang_ext.cpu.attention import RaggedBlock, attend, attend_groups, make_plan, ragged_plans

        def run(self, q, k, v, layer, fb, save_kv_cache, *, block, causal, ragged=None, prefix_lens=None,
                sinks=None):
            if save_kv_cache and k is not None and v is not None:
                self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(fb.out_cache_loc, self.swa_out_cache_loc), k, v)
            # a non-causal layer's window too (upstream's torch-native drops it): a DFlash2 drafter's sliding
            # layers are non-causal (is_causal: false), trained with the window, which GPU attention applies
            # (SGLang's FlashInfer and Triton backends pass it whatever the causality)
            window = layer.sliding_window_size if layer.sliding_window_size not in (None, -1) else None
            plans = fb.__dict__.setdefault("_dflash_serve_block_plans", {})
            key = (self.req_to_token_pool.req_to_token.data_ptr(), block, causal, window, prefix_lens is None)
            q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
            k_buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
            v_buf = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
            if ragged is not None:
                groups = plans.get(key)
                if groups is None:
                    groups = plans[key] = ragged_plans(self.req_to_token_pool.req_to_token, fb.req_pool_indices,
                                                       fb.seq_lens if prefix_lens is None else prefix_lens, ragged,
                                                       causal=causal, sliding_window=window)
                out = attend_groups(groups, q, k_buf, v_buf, layer.scaling, sinks)
                return out.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)
            plan = plans.get(key)
            if plan is None:
                # TARGET_VERIFY: seq_lens excludes the block being verified/drafted; DECODE: it includes the token.
                prefix_lens = fb.seq_lens if fb.forward_mode.is_target_verify() else fb.seq_lens - 1
                plan = plans[key] = make_plan(self.req_to_token_pool.req_to_token, fb.req_pool_indices, prefix_lens,
                                              block, causal=causal, sliding_window=window,
                                              tree=tree_mask(fb, block) if causal else None)
            out = attend(plan, q, k_buf, v_buf, layer.scaling, sinks)
            return out.reshape(-1, layer.tp_q_head_num * layer.v_head_dim)

        def make_extend(original_extend):
            def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
                # gpt-oss passes its attention sinks; upstream's torch-native methods take no such argument
                sinks = kwargs.pop("sinks", None)
                if layer.is_cross_attention:
                    return original_extend(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
                if not forward_batch.forward_mode.is_target_verify():
                    if sinks is None:
                        return original_extend(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
                    # a prefill or extend with sinks: each request's new tokens are a ragged block after its prefix
                    lens = forward_batch.extend_seq_lens.long()
                    return run(self, q, k, v, layer, forward_batch, save_kv_cache, block=int(lens.max()),
                               causal=True, ragged=RaggedBlock.of(lens, int(lens.max())),
                               prefix_lens=forward_batch.extend_prefix_lens, sinks=sinks)
                bs = forward_batch.seq_lens.shape[0]
                rows = q.shape[0]
                causal = layer.attn_type != AttentionType.ENCODER_ONLY
                ragged = getattr(forward_batch.spec_info, RAGGED_ATTR, None)
                if ragged is not None:
                    if rows != ragged.rows.shape[0]:
                        raise ValueError(f"ragged TARGET_VERIFY batch has {rows} query rows, its layout "
                                         f"{ragged.rows.shape[0]}")
                    return run(self, q, k, v, layer, forward_batch, save_kv_cache, block=ragged.block,
                               causal=causal, ragged=ragged, sinks=sinks)
                if rows % bs:
                    raise ValueError(f"TARGET_VERIFY batch has {rows} query rows for {bs} requests (not a multiple)")
                return run(self, q, k, v, layer, forward_batch, save_kv_cache, block=rows // bs, causal=causal,
                           sinks=sinks)

            return forward_extend

        def make_decode(original_decode):
            def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
                sinks = kwargs.pop("sinks", None)
                if layer.is_cross_attention:
                    return original_decode(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
                return run(self, q, k, v, layer, forward_batch, save_kv_cache, block=1, causal=True, sinks=sinks)

            return forward_decode

        wrap(cls, "forward_extend", make_extend)
        wrap(cls, "forward_decode", make_decode)

    when_imported("sglang.srt.layers.attention.torch_native_backend", patch)


def _chain_sampling_verify() -> None:
    """speculative/dflash_utils.py: on CPU `tree_speculative_sampling_target_only` is None, so
    `is_dflash_sampling_verify_available()` is False and DFlash silently verifies greedily at
    temperature > 0. Bind a pure-torch chain implementation of the kernel (cpu/sampling.py);
    the target probabilities (temperature, top-k, top-p) are still built by upstream."""

    def patch(du: ModuleType) -> None:
        if du.tree_speculative_sampling_target_only is not None:
            return
        from sglang_ext.cpu.sampling import chain_speculative_sampling_target_only

        du.tree_speculative_sampling_target_only = chain_speculative_sampling_target_only
        du._DFLASH_SAMPLING_VERIFY_AVAILABLE = True

    when_imported("sglang.srt.speculative.dflash_utils", patch)


def _draft_probs_sampling_verify() -> None:
    """kernels/ops/speculative/dspark/dspark_accept.py `_accept_sampling_core` verifies a draft drawn from its own
    distribution q (a DFlash2 selector's path at temperature > 0: dflash_worker_v2 `_selector_sampling_accept`)
    with `chain_speculative_sampling_triton`, a Triton kernel with no CPU device: the first sampled request crashed
    the scheduler. On CPU tensors the same rejection sampling in torch (cpu/sampling.py)."""
    from sglang_ext.cpu.sampling import chain_speculative_sampling_with_draft_probs

    def make(original):
        def sample(*args, **kwargs):
            probs = kwargs.get("target_probs", args[9] if len(args) > 9 else None)
            if probs is None or probs.device.type != "cpu":
                return original(*args, **kwargs)
            return chain_speculative_sampling_with_draft_probs(*args, **kwargs)

        return sample

    def patch(dspark_accept: ModuleType) -> None:
        wrap(dspark_accept, "chain_speculative_sampling_triton", make)

    when_imported("sglang.kernels.ops.speculative.dspark.dspark_accept", patch)


def _dflash2_ops_eager() -> None:
    """models/dflash.py compiles DFlash2's selector (`_score_edges`, `_follow_maps`) and grouped convolution
    (`_grouped_conv`) with torch.compile and marks the block's width static: on CPU each new verify width (and the
    first batch sizes) compiled again inside a decode step, and the adaptive controller, reading those steps' times,
    stopped drafting (docs/BENCHMARKS.md). On CPU they run as the plain functions torch.compile wraps."""

    def patch(dflash: ModuleType) -> None:
        for name in ("_score_edges", "_follow_maps", "_grouped_conv"):
            original = getattr(getattr(dflash, name), "_torchdynamo_orig_callable", None)
            if original is not None:
                setattr(dflash, name, original)

    when_imported("sglang.srt.models.dflash", patch)


def _gated_rmsnorm_in_torch() -> None:
    """kernels/ops/attention/fla/layernorm_gated.py `RMSNorm.forward` (the gated-delta-net output norm of Qwen3.5)
    calls the CPU op only where the CPU has AMX, else the Triton `layernorm_fn`, which has no CPU device: on CPU
    tensors it runs the same math in torch (`cpu/gdn.py rmsnorm_gated`)."""
    from sglang_ext.cpu.gdn import rmsnorm_gated

    def make(original):
        def forward(self, x, z=None):
            if x.device.type != "cpu":
                return original(self, x, z)
            if not (self.norm_before_gate and self.group_size is None and self.activation == "swish"):
                raise NotImplementedError("gated RMSNorm on CPU: only norm-before-gate, one group, swish")
            return rmsnorm_gated(x, self.weight, z, self.eps)

        return forward

    def patch(layernorm_gated: ModuleType) -> None:
        wrap(layernorm_gated.RMSNorm, "forward", make)

    when_imported("sglang.kernels.ops.attention.fla.layernorm_gated", patch)


def _mamba_verify_commit_in_torch() -> None:
    """layers/attention/hybrid_linear_attn_backend.py `update_mamba_state_after_mtp_verify` commits a hybrid target's
    recurrent and conv states for the accepted prefix through `scatter_mamba_states_after_mtp_verify`, Triton
    kernels that refuse CPU tensors: on CPU the same gather-scatter in torch (`cpu/gdn.py`)."""
    from sglang_ext.cpu.gdn import scatter_mamba_states_after_verify

    def make(original):
        def scatter(mamba_caches, *args, **kwargs):
            if mamba_caches.temporal.device.type != "cpu":
                return original(mamba_caches, *args, **kwargs)
            return scatter_mamba_states_after_verify(mamba_caches, *args, **kwargs)

        return scatter

    def patch(backend: ModuleType) -> None:
        wrap(backend, "scatter_mamba_states_after_mtp_verify", make)

    when_imported("sglang.srt.layers.attention.hybrid_linear_attn_backend", patch)


_PATCHES = [
    _builtin_dflash_on_cpu,
    _torch_native_draft_backend,
    _record_stream_cpu_noop,
    _dflash_draft_torch_qk_norm_rope,
    _input_embeds_in_runner_dtype,
    _torch_native_block_attention,
    _chain_sampling_verify,
    _draft_probs_sampling_verify,
    _dflash2_ops_eager,
    _gated_rmsnorm_in_torch,
    _mamba_verify_commit_in_torch,
]
