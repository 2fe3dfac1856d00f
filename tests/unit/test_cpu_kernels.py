"""Pure-torch CPU kernels against straightforward references."""
from __future__ import annotations

import math

import pytest
import torch

from sglang_ext.cpu import kernels
from sglang_ext.cpu.attention import block_attention
from sglang_ext.cpu.sampling import chain_speculative_sampling_target_only


@pytest.mark.parametrize("start,end", [
    ([0, 5, 3], [7, 9, 3]),  # ragged, with an empty range
    ([0, 5, 3], [4, 9, 7]),  # one length (a decode step's reservation / window): the grid path
    ([2, 5, 3], [2, 5, 3]),  # nothing to write
])
def test_assign_req_to_token_pool_and_inverse_gather(start, end):
    g = torch.Generator().manual_seed(0)
    req_to_token = torch.zeros(6, 32, dtype=torch.int32)
    pool_idx = torch.tensor([4, 1, 2])
    start, end = torch.tensor(start), torch.tensor(end)
    locs = torch.randint(0, 1000, (int((end - start).sum()),), generator=g)
    kernels.assign_req_to_token_pool_cpu(pool_idx, req_to_token, start, end, locs, 32)
    expected = torch.zeros_like(req_to_token)
    off = 0
    for r, s, e in zip(pool_idx.tolist(), start.tolist(), end.tolist()):
        expected[r, s:e] = locs[off:off + e - s]
        off += e - s
    assert torch.equal(req_to_token, expected)
    out = torch.empty_like(locs)
    kernels.assign_extend_cache_locs_cpu(pool_idx, req_to_token, start, end, out, 32)
    assert torch.equal(out, locs)


def test_copy_all_layer_kv_cache_moves_rows_in_every_buffer():
    bufs = [torch.arange(40, dtype=torch.float32).view(10, 4).clone(), torch.arange(30, dtype=torch.int16).view(10, 3).clone()]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in bufs])
    ref = [b.clone() for b in bufs]
    tgt, src = torch.tensor([0, 1, 2]), torch.tensor([1, 2, 9])  # overlapping move
    kernels.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, r in zip(bufs, ref):
        r[tgt] = r[src].clone()
        assert torch.equal(b, r)


def naive_attention(q, k_cache, v_cache, req_to_token, pool_idx, prefix, block, causal, window):
    outs = []
    hq, hkv = q.shape[1], k_cache.shape[1]
    for i in range(len(prefix)):
        n_kv = int(prefix[i]) + block
        keys = k_cache[req_to_token[pool_idx[i], :n_kv].long()].repeat_interleave(hq // hkv, dim=1)
        vals = v_cache[req_to_token[pool_idx[i], :n_kv].long()].repeat_interleave(hq // hkv, dim=1)
        for t in range(block):
            pos = int(prefix[i]) + t
            qv = q[i * block + t]  # [H, D]
            scores = torch.einsum("hd,lhd->hl", qv, keys) / math.sqrt(q.shape[-1])
            allowed = torch.ones(n_kv, dtype=torch.bool)
            if causal:
                allowed &= torch.arange(n_kv) <= pos
            if window is not None:
                allowed &= torch.arange(n_kv) >= pos - window
            scores[:, ~allowed] = float("-inf")
            outs.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), vals))
    return torch.stack(outs)


@pytest.mark.parametrize("causal, window, block, prefix", [
    (True, None, 4, [5, 0, 17]), (False, None, 4, [5, 0, 17]), (True, 3, 4, [5, 0, 17]), (True, None, 1, [5, 0, 17]),
    (False, None, 4, [9, 9, 9]),  # uniform lengths, non-causal: the mask-free path
])
def test_block_attention_matches_naive(causal, window, block, prefix):
    g = torch.Generator().manual_seed(1)
    hq, hkv, d, slots = 4, 2, 8, 200
    k_cache, v_cache = torch.randn(slots, hkv, d, generator=g), torch.randn(slots, hkv, d, generator=g)
    prefix = torch.tensor(prefix)  # ragged cases include an empty prefix
    pool_idx = torch.tensor([2, 0, 1])
    req_to_token = torch.randperm(slots, generator=g)[: 3 * 40].view(3, 40).to(torch.int32)
    q = torch.randn(len(prefix) * block, hq, d, generator=g)
    got = block_attention(q, k_cache, v_cache, req_to_token, pool_idx, prefix, block, causal=causal, sliding_window=window)
    want = naive_attention(q, k_cache, v_cache, req_to_token, pool_idx, prefix, block, causal, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_tree_block_attention_is_plain_attention_along_each_path():
    """A tree verify's query at node i attends to the prefix, the root, its ancestors and itself (ancestor_mask):
    exactly the causal attention of plain decoding over the sequence prefix + root-to-node path."""
    from sglang_ext.cpu.attention import attend, make_plan
    from sglang_ext.tree.build import build_trees
    from sglang_ext.tree.mask import ancestor_mask

    g = torch.Generator().manual_seed(3)
    hq, hkv, d, slots, n = 4, 2, 8, 300, 7
    k_cache, v_cache = torch.randn(slots, hkv, d, generator=g), torch.randn(slots, hkv, d, generator=g)
    prefix = torch.tensor([5, 0, 12])
    pool_idx = torch.tensor([1, 2, 0])
    req_to_token = torch.randperm(slots, generator=g)[: 3 * 40].view(3, 40).to(torch.int32)
    top = torch.topk(torch.log_softmax(torch.randn(3, 4, 9, generator=g), -1), 3, dim=-1)
    trees = build_trees(top.values, top.indices, n - 1)
    mask = ancestor_mask(trees.parent)
    q = torch.randn(3 * n, hq, d, generator=g)
    got = attend(make_plan(req_to_token, pool_idx, prefix, n, causal=True, tree=mask), q, k_cache, v_cache)
    for r in range(3):
        for i in range(n):
            cols = mask[r, i].nonzero().flatten()  # root .. node i, in column (= depth) order
            seq = torch.cat([req_to_token[pool_idx[r], : prefix[r]],
                             req_to_token[pool_idx[r], prefix[r] + cols]]).long()
            keys = k_cache[seq].repeat_interleave(hq // hkv, dim=1)
            vals = v_cache[seq].repeat_interleave(hq // hkv, dim=1)
            scores = torch.einsum("hd,lhd->hl", q[r * n + i], keys) / math.sqrt(d)
            want = torch.einsum("hl,lhd->hd", scores.softmax(-1), vals)
            torch.testing.assert_close(got[r * n + i], want, rtol=1e-5, atol=1e-5)


# --- chain speculative sampling ---------------------------------------------------------

def kernel_reference(candidates, coins, final_coins, probs, t_single=1.0, t_acc=1.0):
    """Line-by-line transcription of sampling.cuh (tree_speculative_sampling_target_only) for chains."""
    bs, n, vocab = probs.shape
    predicts, accepted_all = torch.zeros(bs * n, dtype=torch.int64), []
    for b in range(bs):
        row, coin, last, acc = 0, float(coins[b, 0]), b * n, 0
        draft_probs = torch.zeros(vocab)
        rejected = None
        for j in range(1, n):
            tok = int(candidates[b, j])
            p = float(probs[b, row, tok])
            if p > 0 and (coin < p / t_acc or p >= t_single):
                predicts[last] = tok
                acc += 1
                row, coin, last = j, float(coins[b, j]), b * n + j
            else:
                rejected = tok
                break
        q = probs[b, row].clone()
        if rejected is not None:
            draft_probs[rejected] = q[rejected]
            q = (q - draft_probs).clamp(min=0)
        u = float(final_coins[b]) * float(q.sum())
        cdf = torch.cumsum(q, 0)
        idx = int((cdf > u).nonzero()[0]) if bool((cdf > u).any()) else int((q > 0).nonzero()[-1])
        predicts[last] = idx
        accepted_all.append(acc)
    return predicts, torch.tensor(accepted_all)


def run_sampler(candidates, coins, final_coins, probs):
    bs, n = candidates.shape
    predicts = torch.full((bs * n,), -7, dtype=torch.int32)
    accept_index = torch.empty(bs, n, dtype=torch.int32)
    accept_num = torch.empty(bs, dtype=torch.int32)
    ri = torch.arange(bs * n).view(bs, n)
    nxt = torch.arange(1, n + 1).repeat(bs, 1)
    nxt[:, -1] = -1
    sib = torch.full((bs, n), -1)
    chain_speculative_sampling_target_only(predicts, accept_index, accept_num, candidates, ri, nxt, sib, coins,
                                           final_coins, probs, torch.zeros_like(probs))
    return predicts, accept_index, accept_num


def test_sampler_matches_the_kernel_semantics():
    g = torch.Generator().manual_seed(3)
    bs, n, vocab = 64, 6, 5
    probs = torch.softmax(torch.randn(bs, n, vocab, generator=g) * 2, -1)
    probs[probs < 0.05] = 0  # top-k/top-p style zeros
    probs = probs / probs.sum(-1, keepdim=True)
    candidates = torch.randint(0, vocab, (bs, n), generator=g)
    coins, final = torch.rand(bs, n, generator=g), torch.rand(bs, generator=g)
    predicts, accept_index, accept_num = run_sampler(candidates, coins, final, probs)
    ref_pred, ref_acc = kernel_reference(candidates, coins, final, probs)
    assert torch.equal(accept_num.long(), ref_acc)
    for b in range(bs):
        a = int(ref_acc[b])
        assert accept_index[b, : a + 1].tolist() == [b * n + j for j in range(a + 1)]
        assert predicts[b * n: b * n + a + 1].tolist() == ref_pred[b * n: b * n + a + 1].tolist()
    assert 0 < int(accept_num.sum()) < bs * (n - 1)  # the case mix exercised both accept and reject


def test_sampler_output_distribution_equals_the_target():
    """Rejection sampling with a deterministic draft is exact: the first emitted token is
    distributed as the target's q_0, whatever the draft proposes."""
    from scipy.stats import chisquare

    g = torch.Generator().manual_seed(4)
    trials, vocab, n = 20000, 6, 3
    q0 = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.07, 0.03])
    probs = torch.softmax(torch.randn(trials, n, vocab, generator=g), -1)
    probs[:, 0] = q0
    candidates = torch.zeros(trials, n, dtype=torch.int64)
    candidates[:, 1] = 1  # draft proposes token 1 (target mass 0.25) first
    candidates[:, 2] = 0
    predicts, _, _ = run_sampler(candidates, torch.rand(trials, n, generator=g), torch.rand(trials, generator=g), probs)
    first = predicts.view(trials, n)[:, 0]
    counts = torch.bincount(first.long(), minlength=vocab).double()
    p = chisquare(counts.numpy(), (q0.double() * trials).numpy()).pvalue
    assert p > 1e-4, (counts / trials, q0)


def test_sampler_rejects_trees():
    candidates = torch.zeros(1, 3, dtype=torch.int64)
    sib = torch.tensor([[-1, 2, -1]])
    with pytest.raises(NotImplementedError, match="chains only"):
        chain_speculative_sampling_target_only(
            torch.zeros(3, dtype=torch.int32), torch.zeros(1, 3, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
            candidates, torch.arange(3).view(1, 3), torch.tensor([[1, 2, -1]]), sib, torch.rand(1, 3), torch.rand(1),
            torch.full((1, 3, 4), 0.25), torch.zeros(1, 3, 4))


@pytest.mark.parametrize("causal", [True, False])
def test_ragged_block_attention_is_each_requests_own_block(causal):
    """A ragged forward (request i: lens[i] new tokens, packed request-major) attends, row for row, exactly as a
    block of lens[i] tokens would for that request alone: the target's causal verify and the draft's
    bidirectional block (keys end at prefix_i + lens[i], never at the widest request's)."""
    from sglang_ext.cpu.attention import RaggedBlock, attend_groups, ragged_plans

    g = torch.Generator().manual_seed(5)
    hq, hkv, d, slots, width = 4, 2, 8, 300, 6
    k_cache, v_cache = torch.randn(slots, hkv, d, generator=g), torch.randn(slots, hkv, d, generator=g)
    prefix = torch.tensor([5, 11, 3, 8])
    lens = torch.tensor([1, 6, 3, 2])
    pool_idx = torch.tensor([3, 1, 0, 2])
    req_to_token = torch.randperm(slots, generator=g)[: 4 * 40].view(4, 40).to(torch.int32)
    ragged = RaggedBlock.of(lens, width)
    q = torch.randn(int(lens.sum()), hq, d, generator=g)
    groups = ragged_plans(req_to_token, pool_idx, prefix, ragged, causal=causal)
    assert len(groups) == 4  # one per distinct length
    got = attend_groups(groups, q, k_cache, v_cache)
    start = 0
    for i in range(4):
        n = int(lens[i])
        want = naive_attention(q[start:start + n], k_cache, v_cache, req_to_token, pool_idx[i:i + 1],
                               prefix[i:i + 1], n, causal, None)
        torch.testing.assert_close(got[start:start + n], want, rtol=1e-5, atol=1e-5)
        start += n
