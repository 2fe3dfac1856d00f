"""The CPU layer's rejection sampler for drafts with their own distribution q (a DFlash2 selector's path): the very
outputs of upstream's Triton kernel for the same coins, and exact -- the committed token is distributed as the
target's p whatever q is.

Upstream's `chain_speculative_sampling_triton` (kernels/ops/speculative/reject_sampling.py) has no CPU device: on a
CPU server a DFlash2 drafter's first sampled request crashed the scheduler ("0 active drivers"). The comparison runs
the kernel under Triton's interpreter in a child process (TRITON_INTERPRET must be set before Triton is imported).
"""
from __future__ import annotations

import json

import pytest
import torch
from scipy.stats import chisquare

from sglang_ext.cpu.sampling import chain_speculative_sampling_with_draft_probs
from tests.conftest import child_result

PROBE = r"""
import json, sys
import torch
from sglang.kernels.ops.speculative.reject_sampling import chain_speculative_sampling_triton as triton_kernel
from sglang_ext.cpu.sampling import chain_speculative_sampling_with_draft_probs as torch_kernel

out = []
for seed, bs, n, vocab in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(bs, n, vocab, generator=g) * 2, -1)
    draft = torch.softmax(torch.randn(bs, n - 1, vocab, generator=g) * 2, -1)
    # drafts drawn from q (the selector's contract), one row with a token q gives no mass (never accepted)
    cand = torch.randint(0, vocab, (bs, n), generator=g)
    if n > 1:
        cand[:, 1:] = torch.multinomial(draft.view(-1, vocab), 1, generator=g).view(bs, n - 1)
        draft[0, 0, cand[0, 1]] = 0.0
    coins = torch.rand(bs, max(n - 1, 1), generator=g)
    final = torch.rand(bs, generator=g)
    ridx = torch.arange(bs * n).view(bs, n)
    runs = []
    for kernel in (triton_kernel, torch_kernel):
        predicts = torch.full((bs * n,), -7, dtype=torch.int32)
        accept_index = torch.full((bs, n), -1, dtype=torch.int32)
        accept_num = torch.zeros(bs, dtype=torch.int32)
        kernel(predicts, accept_index, accept_num, cand, ridx, None, None, coins, final, target, draft, 1.0, 1.0,
               True)
        runs.append([predicts.tolist(), accept_index.tolist(), accept_num.tolist()])
    out.append(runs)
print("RESULT" + json.dumps(out))
"""

CASES = [(0, 6, 5, 64), (1, 4, 2, 64), (2, 3, 8, 40), (3, 5, 1, 16), (4, 8, 16, 100)]


def test_the_torch_sampler_gives_the_triton_kernels_outputs_for_the_same_coins():
    results = child_result("-c", PROBE, json.dumps(CASES), TRITON_INTERPRET="1")
    accepted = 0
    for case, (triton_run, torch_run) in zip(CASES, results, strict=True):
        assert torch_run == triton_run, f"case (seed, bs, n, vocab) {case}"
        accepted += sum(triton_run[2])
    assert accepted > 0  # some drafts accepted, so the accepted-prefix outputs were compared too


@pytest.mark.parametrize("n", [2, 4])
def test_the_first_committed_token_is_distributed_as_the_target_whatever_q_is(n):
    """One request, 20,000 draws: the token committed after the anchor (the first draft if accepted, else the
    residual's) follows p at row 0 though q is far from it; chi-square at alpha 0.001 over 10 tokens. Drawing the
    residual from p instead of relu(p - q) (the classic mistake) fails it: p-value < 1e-10 here."""
    vocab, draws = 10, 20_000
    g = torch.Generator().manual_seed(n)
    p = torch.softmax(torch.randn(n, vocab, generator=g), -1)
    q = torch.softmax(torch.randn(n - 1, vocab, generator=g) * 2, -1)
    target = p.expand(draws, n, vocab).contiguous()
    draft = q.expand(draws, n - 1, vocab).contiguous()
    cand = torch.zeros(draws, n, dtype=torch.int64)
    cand[:, 1:] = torch.multinomial(q, draws, replacement=True, generator=g).T
    predicts = torch.zeros(draws * n, dtype=torch.int64)
    accept_index = torch.full((draws, n), -1, dtype=torch.int64)
    accept_num = torch.zeros(draws, dtype=torch.int64)
    chain_speculative_sampling_with_draft_probs(
        predicts, accept_index, accept_num, cand, torch.arange(draws * n).view(draws, n), None, None,
        torch.rand(draws, n - 1, generator=g), torch.rand(draws, generator=g), target, draft)
    first = predicts.view(draws, n)[:, 0]
    observed = torch.bincount(first, minlength=vocab).double()
    assert 0 < int(accept_num.sum()) < draws * (n - 1)  # some accepted, some rejected: both branches drawn
    expected = p[0].double() / p[0].double().sum() * draws
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > 0.001
