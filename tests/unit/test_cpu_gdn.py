"""The CPU layer's gated-delta-net ops (sglang_ext/cpu/gdn.py) against transformers' own Qwen3.5 math, and the
speculative contract: a verify of n positions then the commit of step j leaves exactly the state that decoding
j + 1 tokens one by one leaves -- the recurrent (SSM) state and the conv window both."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from sglang_ext.cpu import gdn

H, HV, K, V, W, SLOTS = 2, 4, 8, 8, 4, 5
DIM = 2 * H * K + HV * V  # the conv runs over [q | k | v]


def _inputs(t: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(q=r(1, t, H, K), k=r(1, t, H, K), v=r(1, t, HV, V), a=r(t, HV), b=r(t, HV),
                A_log=r(HV) * 0.5, dt_bias=r(HV) * 0.5, state=r(SLOTS, HV, V, K) * 0.1)


def test_prefill_rule_equals_transformers_chunked_rule():
    x = _inputs(13)
    g, beta = gdn.fused_gdn_gating_cpu(x["A_log"], x["a"], x["b"], x["dt_bias"])
    state = x["state"].clone()
    o, _, _ = gdn.chunk_gated_delta_rule_cpu(x["q"], x["k"], x["v"], g, beta, state,
                                             cu_seqlens=torch.tensor([0, 13]), use_qk_l2norm_in_kernel=True,
                                             initial_state_indices=torch.tensor([3]))
    rep = HV // H  # transformers repeats q/k per value head before its rule, as the GDN layer does
    ref_o, ref_state = hf.torch_chunk_gated_delta_rule(
        x["q"].repeat_interleave(rep, 2), x["k"].repeat_interleave(rep, 2), x["v"], g=g, beta=beta,
        initial_state=x["state"][3:4].transpose(-1, -2), output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o, ref_o, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state[3], ref_state[0].transpose(-1, -2), rtol=1e-4, atol=1e-4)
    assert torch.equal(state[[0, 1, 2, 4]], x["state"][[0, 1, 2, 4]])  # other requests' slots untouched


def test_conv_prefill_and_update_equal_a_depthwise_conv():
    g = torch.Generator().manual_seed(1)
    x, weight = torch.randn(DIM, 9, generator=g), torch.randn(DIM, W, generator=g)
    conv = torch.zeros(SLOTS, DIM, W - 1)
    out = gdn.causal_conv1d_fn_cpu(x, weight, None, activation="silu", conv_states=conv,
                                   has_initial_state=torch.tensor([False]), cache_indices=torch.tensor([2]),
                                   query_start_loc=torch.tensor([0, 9]))
    # transformers' own torch fallback for Qwen3.5's conv (no causal-conv1d package): a depthwise conv1d
    ref = torch.nn.functional.silu(
        torch.nn.functional.conv1d(x.unsqueeze(0), weight.unsqueeze(1), padding=W - 1, groups=DIM)[..., :9])
    torch.testing.assert_close(out, ref[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(conv[2], x[:, -(W - 1):])
    nxt = torch.randn(1, DIM, generator=g)
    step = gdn.causal_conv1d_update_cpu(nxt, conv, weight, None, "silu", conv_state_indices=torch.tensor([2]))
    full = torch.cat([x, nxt.T], 1)
    ref = torch.nn.functional.silu(torch.nn.functional.conv1d(full.unsqueeze(0), weight.unsqueeze(1),
                                                              padding=W - 1, groups=DIM)[..., :10])
    torch.testing.assert_close(step[0], ref[0, :, -1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("conv_dtype", [torch.float32, torch.bfloat16])  # SGLang's default conv state: bf16
@pytest.mark.parametrize("n", [1, 3, 8])
def test_verify_then_commit_equals_decoding_the_accepted_prefix(n, conv_dtype):
    """A verify of n positions (disable_state_update, per-step states aside), then upstream's commit of step j:
    the outputs and the state are decoding j + 1 tokens' -- for every j, width 1 included, an fp32 model over a
    bf16 conv state too; an unaccepted request (-1) keeps its own."""
    x = _inputs(n, seed=n)
    g = torch.Generator().manual_seed(10 + n)
    mixed, weight = torch.randn(1, DIM, n, generator=g), torch.randn(DIM, W, generator=g)
    conv0 = torch.randn(SLOTS, DIM, W - 1, generator=g).to(conv_dtype)
    for j in range(n):
        ssm, conv = x["state"].clone(), conv0.clone()
        inter_ssm, inter_conv = torch.zeros(3, n, HV, V, K), torch.zeros(3, n, DIM, W - 1, dtype=conv_dtype)
        verify_conv = gdn.causal_conv1d_update_cpu(mixed, conv, weight, None, "silu",
                                                   conv_state_indices=torch.tensor([1]),
                                                   intermediate_conv_window=inter_conv,
                                                   intermediate_state_indices=torch.tensor([2]))
        verify_o = gdn.fused_sigmoid_gating_delta_rule_update_cpu(
            x["A_log"], x["dt_bias"], x["q"], x["k"], x["v"], x["a"], x["b"], ssm, torch.tensor([1]),
            cu_seqlens=torch.tensor([0, n]), use_qk_l2norm_in_kernel=True, disable_state_update=True,
            intermediate_states_buffer=inter_ssm, intermediate_state_indices=torch.tensor([2]), cache_steps=n)
        assert torch.equal(ssm, x["state"])  # the verify leaves the live state alone
        caches = SimpleNamespace(temporal=ssm.unsqueeze(0), intermediate_ssm=inter_ssm.unsqueeze(0),
                                 conv=[conv.unsqueeze(0)], intermediate_conv_window=[inter_conv.unsqueeze(0)])
        gdn.scatter_mamba_states_after_verify(caches, torch.tensor([1, 4]), torch.tensor([j, -1]),
                                              src_indices_raw=torch.tensor([2, 0]))
        ref_ssm, ref_conv = x["state"].clone(), conv0.clone()
        for t in range(j + 1):  # plain decoding, one token per step
            o_t = gdn.fused_sigmoid_gating_delta_rule_update_cpu(
                x["A_log"], x["dt_bias"], x["q"][:, t:t + 1], x["k"][:, t:t + 1], x["v"][:, t:t + 1],
                x["a"][t:t + 1], x["b"][t:t + 1], ref_ssm, torch.tensor([1]), cu_seqlens=torch.tensor([0, 1]),
                use_qk_l2norm_in_kernel=True)
            c_t = gdn.causal_conv1d_update_cpu(mixed[:, :, t], ref_conv, weight, None, "silu",
                                               conv_state_indices=torch.tensor([1]))
            torch.testing.assert_close(verify_o[:, t], o_t[:, 0])
            torch.testing.assert_close(verify_conv[:, :, t], c_t)
        torch.testing.assert_close(ssm[1], ref_ssm[1])
        torch.testing.assert_close(conv[1], ref_conv[1])
        assert torch.equal(ssm[4], x["state"][4]) and torch.equal(conv[4], conv0[4])


def test_qwen3_5_projection_helpers():
    g = torch.Generator().manual_seed(3)
    qkvz, ba = torch.randn(5, 2 * H * K + 2 * HV * V, generator=g), torch.randn(5, 2 * HV, generator=g)
    qkv, z, b, a = gdn.fused_qkvzba_split_reshape_cat_contiguous_cpu(qkvz, ba, H, HV, K, V)
    assert torch.equal(torch.cat([qkv, z.reshape(5, -1)], 1), qkvz) and torch.equal(torch.cat([b, a], 1), ba)
    x, gate = torch.randn(5, 16, generator=g), torch.randn(5, 16, generator=g)
    ref = x * torch.sigmoid(gate)
    gdn.fused_sigmoid_mul_cpu(x, gate)
    torch.testing.assert_close(x, ref)
    norm = hf.Qwen3_5RMSNormGated(V, eps=1e-6)
    torch.nn.init.normal_(norm.weight, generator=g)
    y, z = torch.randn(5, V, generator=g), torch.randn(5, V, generator=g)
    torch.testing.assert_close(gdn.rmsnorm_gated(y, norm.weight, z, 1e-6), norm(y, z))
