"""Pure-torch versions of the `sgl_kernel` CPU ops SGLang's CPU path calls for Qwen3.5's gated-delta-net layers.

Who calls them (SGLang 0.5.23, `is_cpu()` branches): `layers/attention/linear/gdn_backend.py` (causal conv1d for
prefill and decode/verify, the gate), `layers/attention/linear/kernels/gdn_triton.py` (the chunked gated delta rule
for prefill, the fused sigmoid-gated recurrent update for decode and target verify), `models/qwen3_5.py` (the
gated full attention's Q/K Gemma RMSNorm with its gate, the sigmoid gate, the contiguous QKVZ/BA split).

The layouts are SGLang's: the recurrent state is [slots, HV, V, K] (V rows, K columns, as its Triton kernels read
it), the conv state [slots, dim, W - 1] (oldest column first); a negative state index is a padded row, skipped.
The chunked rule is computed token by token: the same recurrence, exact, and the tiny test models make it cheap.
Target verify (`disable_state_update`) leaves the live state alone and writes the state after every draft token to
SGLang's intermediate buffers, which upstream's DFlash worker commits for the accepted prefix.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _gdn_gates(A_log, a, b, dt_bias, softplus_beta: float = 1.0, softplus_threshold: float = 20.0):
    """g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), in fp32 (the Triton kernel's math)."""
    x = a.float() + dt_bias.float()
    sp = torch.where(softplus_beta * x <= softplus_threshold,
                     torch.log1p(torch.exp(softplus_beta * x)) / softplus_beta, x)
    return -torch.exp(A_log.float()) * sp, torch.sigmoid(b.float())


def fused_gdn_gating_cpu(A_log, a, b, dt_bias, beta: float = 1.0, threshold: float = 20.0):
    """gdn_backend `_prefill_gates`: a, b [T, HV] -> (g, beta), each [1, T, HV] fp32."""
    g, bt = _gdn_gates(A_log, a, b, dt_bias, beta, threshold)
    return g.unsqueeze(0), bt.unsqueeze(0)


def _recur(q, k, v, g, beta, state, scale, l2norm: bool, states_out=None):
    """One sequence: q, k [T, H, K], v [T, HV, V], g, beta [T, HV], state [HV, V, K] fp32 (updated in place).
    Returns o [T, HV, V]; `states_out` [>= T, HV, V, K], when given, receives the state after each token."""
    hv = v.shape[1]
    rep = hv // q.shape[1]
    q, k = q.float(), k.float()
    if l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q = q.repeat_interleave(rep, dim=1) * scale
    k = k.repeat_interleave(rep, dim=1)
    v = v.float()
    out = torch.empty(v.shape, dtype=torch.float32)
    for t in range(v.shape[0]):
        state.mul_(torch.exp(g[t]).view(hv, 1, 1))
        kv_mem = torch.einsum("hvk,hk->hv", state, k[t])
        delta = (v[t] - kv_mem) * beta[t].unsqueeze(-1)
        state.add_(delta.unsqueeze(-1) * k[t].unsqueeze(1))
        out[t] = torch.einsum("hvk,hk->hv", state, q[t])
        if states_out is not None:
            states_out[t] = state.to(states_out.dtype)
    return out


def _bounds(cu_seqlens, total: int) -> list[tuple[int, int]]:
    cu = [0, total] if cu_seqlens is None else [int(x) for x in cu_seqlens.tolist()]
    return list(zip(cu[:-1], cu[1:]))


def chunk_gated_delta_rule_cpu(q, k, v, g, beta, initial_state, cu_seqlens=None, head_first: bool = False,
                               use_qk_l2norm_in_kernel: bool = False, initial_state_indices=None, scale=None,
                               **_unused):
    """gdn_triton `extend` (prefill): q, k [1, T, H, K], v [1, T, HV, V], g, beta [1, T, HV]; the state of
    sequence i is initial_state[initial_state_indices[i]], updated in place. Returns (o [1, T, HV, V], None, None):
    the caller reads only o (no per-chunk checkpoints on CPU)."""
    if head_first:
        raise NotImplementedError("chunk_gated_delta_rule_cpu: head_first=True is not a layout SGLang's CPU path uses")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    o = torch.zeros(v.shape, dtype=v.dtype)
    for i, (s, e) in enumerate(_bounds(cu_seqlens, v.shape[1])):
        slot = i if initial_state_indices is None else int(initial_state_indices[i])
        if slot < 0 or e == s:
            continue
        st = initial_state[slot].float()
        o[0, s:e] = _recur(q[0, s:e], k[0, s:e], v[0, s:e], g[0, s:e].float(), beta[0, s:e].float(), st, scale,
                           use_qk_l2norm_in_kernel).to(v.dtype)
        initial_state[slot] = st.to(initial_state.dtype)
    return o, None, None


def fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt_bias, q, k, v, a, b, initial_state_source,
                                               initial_state_indices, cu_seqlens=None, use_qk_l2norm_in_kernel=False,
                                               softplus_beta: float = 1.0, softplus_threshold: float = 20.0,
                                               scale=None, is_kda: bool = False, disable_state_update: bool = False,
                                               intermediate_states_buffer=None, intermediate_state_indices=None,
                                               cache_steps=None, retrieve_parent_token=None, **_unused):
    """gdn_triton `decode` and `target_verify`: the gate and the recurrent rule in one pass.
    q, k [1, T, H, K], v [1, T, HV, V], a, b [T, HV]; sequences by cu_seqlens. Decode updates
    initial_state_source[initial_state_indices[i]]; target verify (disable_state_update) leaves it and writes the
    state after draft token t to intermediate_states_buffer[intermediate_state_indices[i], t]."""
    if is_kda:
        raise NotImplementedError("fused_sigmoid_gating_delta_rule_update_cpu: KDA gating has no CPU version")
    if retrieve_parent_token is not None:
        raise NotImplementedError("fused_sigmoid_gating_delta_rule_update_cpu: tree verify (retrieve_parent_token) "
                                  "has no CPU version; verify a chain")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g, beta = _gdn_gates(A_log, a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]), dt_bias,
                         softplus_beta, softplus_threshold)
    o = torch.zeros(v.shape, dtype=v.dtype)
    for i, (s, e) in enumerate(_bounds(cu_seqlens, v.shape[1])):
        slot = int(initial_state_indices[i])
        if slot < 0 or e == s:
            continue
        st = initial_state_source[slot].float().clone()
        buf = None
        if intermediate_states_buffer is not None:
            buf = intermediate_states_buffer[int(intermediate_state_indices[i])]
        o[0, s:e] = _recur(q[0, s:e], k[0, s:e], v[0, s:e], g[s:e], beta[s:e], st, scale,
                           use_qk_l2norm_in_kernel, states_out=buf).to(v.dtype)
        if not disable_state_update:
            initial_state_source[slot] = st.to(initial_state_source.dtype)
    return o


def _conv_seq(x, weight, bias, window, silu: bool, windows_out=None, stored_history: bool = False):
    """One sequence: x [dim, L], window [dim, W - 1] (the inputs before x, oldest first). Returns (out [dim, L],
    the last W - 1 inputs); `windows_out` [>= L, dim, W - 1], when given, gets the window after each token.
    `stored_history`: each token sees the earlier ones as the conv state stores them (its dtype, bf16 by default),
    as decoding them one by one would -- so a verify of L tokens computes what L decode steps compute."""
    w = weight.shape[1]
    full = torch.cat([window.to(x.dtype), x], dim=1)  # [dim, W - 1 + L]
    if stored_history:
        full = full.to(window.dtype).to(x.dtype)
    cols = full.unfold(1, w, 1)  # [dim, L, W]
    if stored_history:  # the token itself is read as computed
        cols = cols.clone()
        cols[:, :, -1] = x
    out = (cols.float() * weight.float().unsqueeze(1)).sum(-1)
    if bias is not None:
        out = out + bias.float().unsqueeze(1)
    if silu:
        out = F.silu(out)
    if windows_out is not None:
        for t in range(x.shape[1]):
            windows_out[t] = full[:, t + 1:t + w].to(windows_out.dtype)
    return out.to(x.dtype), full[:, -(w - 1):] if w > 1 else full[:, :0]


def _silu(activation) -> bool:
    return activation in ("silu", "swish", True)


def causal_conv1d_fn_cpu(x, weight, bias=None, activation=None, conv_states=None, has_initial_state=None,
                         cache_indices=None, query_start_loc=None, seq_lens_cpu=None, block_table=None, **_unused):
    """gdn_backend `_convolve_prefill`: x [dim, T] (sequences by query_start_loc), weight [dim, W]. Sequence i
    starts from conv_states[cache_indices[i]] when has_initial_state[i], else zeros; its last W - 1 inputs are
    written back there. Returns [dim, T]."""
    if block_table is not None:
        raise NotImplementedError("causal_conv1d_fn_cpu: a paged conv state (block_table) has no CPU version")
    out = torch.zeros_like(x)
    for i, (s, e) in enumerate(_bounds(query_start_loc, x.shape[1])):
        slot = i if cache_indices is None else int(cache_indices[i])
        if slot < 0 or e == s:
            continue
        start = has_initial_state is not None and bool(has_initial_state[i])
        window = conv_states[slot] if start else torch.zeros_like(conv_states[slot])
        out[:, s:e], last = _conv_seq(x[:, s:e], weight, bias, window, _silu(activation))
        conv_states[slot] = last.to(conv_states.dtype)
    return out


def causal_conv1d_update_cpu(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                             conv_state_indices=None, num_accept_tokens=None, intermediate_conv_window=None,
                             intermediate_state_indices=None, retrieve_next_token=None, retrieve_next_sibling=None,
                             retrieve_parent_token=None, pad_slot_id: int = -1, **_unused):
    """gdn_backend decode ([bs, dim]) and target verify ([bs, dim, L]): each row continues from
    conv_state[conv_state_indices[i]] and leaves its last W - 1 inputs there; with `intermediate_conv_window`
    the window after each token goes to intermediate_conv_window[intermediate_state_indices[i], t]."""
    if cache_seqlens is not None or num_accept_tokens is not None or retrieve_parent_token is not None:
        raise NotImplementedError("causal_conv1d_update_cpu: circular states, accept offsets and tree verify have "
                                  "no CPU version")
    squeeze = x.dim() == 2
    xs = x.unsqueeze(-1) if squeeze else x
    out = torch.zeros_like(xs)
    for i in range(xs.shape[0]):
        slot = i if conv_state_indices is None else int(conv_state_indices[i])
        if slot < 0 or slot == pad_slot_id:
            continue
        buf = None
        if intermediate_conv_window is not None:
            buf = intermediate_conv_window[int(intermediate_state_indices[i])]
        out[i], last = _conv_seq(xs[i], weight, bias, conv_state[slot], _silu(activation), windows_out=buf,
                                 stored_history=True)
        conv_state[slot] = last.to(conv_state.dtype)
    return out.squeeze(-1) if squeeze else out


# -- Qwen3.5 full attention and projections (models/qwen3_5.py, is_cpu branches) ------------------------------

def _gemma_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def fused_qk_gemma_rmsnorm_cpu(q, k, q_weight, k_weight, eps: float, head_dim: int):
    """`_apply_qk_norm`: Gemma RMSNorm (weight + 1) of every head of q and k; returns them by head."""
    return (_gemma_rms(q.reshape(-1, head_dim), q_weight, eps), _gemma_rms(k.reshape(-1, head_dim), k_weight, eps))


def fused_qk_gemma_rmsnorm_with_gate_cpu(q_gate, k, q_weight, k_weight, eps: float, head_dim: int, num_heads: int):
    """`forward_prepare_fused_gate`: q_gate [T, heads * 2 * head_dim] holds each head's query then its gate; returns
    (normed q, normed k, gate), each flat per token."""
    t = q_gate.shape[0]
    q, gate = torch.chunk(q_gate.reshape(t, num_heads, 2 * head_dim), 2, dim=-1)
    qn, kn = fused_qk_gemma_rmsnorm_cpu(q, k, q_weight, k_weight, eps, head_dim)
    return qn.reshape(t, -1), kn.reshape(t, -1), gate.reshape(t, -1).contiguous()


def fused_sigmoid_mul_cpu(x, gate) -> None:
    """`fused_sigmoid_mul` (the gated attention output): x *= sigmoid(gate), in place."""
    x.mul_(torch.sigmoid(gate.float()).to(x.dtype).reshape(x.shape))


def fused_qkvzba_split_reshape_cat_contiguous_cpu(mixed_qkvz, mixed_ba, num_heads_qk: int, num_heads_v: int,
                                                  head_qk: int, head_v: int):
    """The contiguous (Qwen3.5) split: mixed_qkvz = [q | k | v | z], mixed_ba = [b | a] ->
    (mixed_qkv [T, q+k+v], z [T, HV, V], b [T, HV], a [T, HV])."""
    qkv = 2 * num_heads_qk * head_qk + num_heads_v * head_v
    t = mixed_qkvz.shape[0]
    return (mixed_qkvz[:, :qkv].contiguous(), mixed_qkvz[:, qkv:].reshape(t, num_heads_v, head_v).contiguous(),
            mixed_ba[:, :num_heads_v].contiguous(), mixed_ba[:, num_heads_v:].contiguous())


def rmsnorm_gated(x, weight, z, eps: float) -> torch.Tensor:
    """fla `layernorm_gated.RMSNorm` (norm before gate, swish): rmsnorm(x) * weight * silu(z)."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    if z is not None:
        out = out * F.silu(z.float())
    return out.to(x.dtype)


# bound onto the `sgl_kernel.mamba` stub module (imported by name)
MAMBA_MODULE = {
    "causal_conv1d_fn_cpu": causal_conv1d_fn_cpu,
    "causal_conv1d_update_cpu": causal_conv1d_update_cpu,
    "chunk_gated_delta_rule_cpu": chunk_gated_delta_rule_cpu,
}
# bound onto `torch.ops.sgl_kernel` (read as attributes at SGLang's module import)
TORCH_OPS = {
    "fused_gdn_gating_cpu": fused_gdn_gating_cpu,
    "fused_sigmoid_gating_delta_rule_update_cpu": fused_sigmoid_gating_delta_rule_update_cpu,
    "fused_sigmoid_mul_cpu": fused_sigmoid_mul_cpu,
    "fused_qk_gemma_rmsnorm_cpu": fused_qk_gemma_rmsnorm_cpu,
    "fused_qk_gemma_rmsnorm_with_gate_cpu": fused_qk_gemma_rmsnorm_with_gate_cpu,
    "fused_qkvzba_split_reshape_cat_contiguous_cpu": fused_qkvzba_split_reshape_cat_contiguous_cpu,
    "fused_rmsnorm_gated_cpu": rmsnorm_gated,
}


# -- the speculative commit (upstream's Triton scatter has no CPU device) --------------------------------------

def _scatter_steps(dst, src, dst_rows, steps, src_rows=None) -> None:
    """dst[:, dst_rows[i]] = src[:, src_rows[i], steps[i]] for every i with steps[i] >= 0 (and a real row)."""
    if dst is None or src is None or steps.numel() == 0:
        return
    steps = steps.long()
    dst_rows = dst_rows.long()
    src_rows = torch.arange(steps.numel()) if src_rows is None else src_rows.long()
    ok = (steps >= 0) & (dst_rows >= 0)
    if bool(ok.any()):
        dst[:, dst_rows[ok]] = src[:, src_rows[ok], steps[ok]].to(dst.dtype)


def scatter_mamba_states_after_verify(mamba_caches, state_indices_tensor, last_correct_step_indices,
                                      mamba_track_indices=None, mamba_steps_to_track=None,
                                      src_indices_raw=None) -> None:
    """`scatter_mamba_states_after_mtp_verify` (kernels/ops/mamba/mamba_state_scatter_triton.py): the recurrent
    and conv states of request i become those after its last accepted verify token (step >= 0; -1 leaves the
    request's state as it is), and the same for the prefix cache's track slots."""
    pairs = [(mamba_caches.temporal, mamba_caches.intermediate_ssm)]
    pairs += [(c, w) for c, w in zip(mamba_caches.conv, mamba_caches.intermediate_conv_window) if c.numel() > 0]
    for dst, src in pairs:
        _scatter_steps(dst, src, state_indices_tensor, last_correct_step_indices, src_indices_raw)
        if mamba_track_indices is not None:
            _scatter_steps(dst, src, mamba_track_indices, mamba_steps_to_track, src_indices_raw)
