"""Pure-torch chain version of SGLang's `tree_speculative_sampling_target_only` kernel.

Same signature and in-place outputs as the CUDA kernel
(sglang/kernels/jit/include/sgl_kernel/speculative/sampling.cuh), specialised to chains
(DFlash drafts one candidate per position, topk = 1). Per request, with target
probabilities q_j at the row of the last accepted token and the coin u_j of that row:

    accept draft token d_{j+1}  iff  q_j(d) > 0 and (u_j < q_j(d) / threshold_acc
                                                    or q_j(d) >= threshold_single)

stop at the first rejection; the final token is drawn by inverse CDF with the final coin
from relu(q - p), where p holds only the rejected candidate's mass (or from q itself when
every draft token was accepted). With thresholds 1.0 this is exact rejection sampling for
a deterministic draft: the output distribution equals sampling from the target alone.
"""
from __future__ import annotations

import torch


def chain_speculative_sampling_target_only(
    predicts: torch.Tensor,  # [bs * n] out: token after each accepted row, then the final token
    accept_index: torch.Tensor,  # [bs, n] out: flat row ids of the anchor + accepted rows
    accept_token_num: torch.Tensor,  # [bs] out: accepted draft tokens
    candidates: torch.Tensor,  # [bs, n]: anchor, then draft tokens
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    uniform_samples: torch.Tensor,  # [bs, n]: coin per row
    uniform_samples_for_final_sampling: torch.Tensor,  # [bs]
    target_probs: torch.Tensor,  # [bs, n, V]
    draft_probs: torch.Tensor,  # [bs, n, V], zeros; unused beyond the kernel's contract
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    deterministic: bool = True,
) -> None:
    bs, n = candidates.shape
    if bool((retrive_next_sibling[:bs] != -1).any()):
        raise NotImplementedError("the CPU speculative sampler handles chains only (topk=1); got a tree")
    device = target_probs.device
    rows = torch.arange(bs, device=device)
    steps = torch.arange(n, device=device)

    # q_j(d_{j+1}) for j = 0..n-2: probability, at row j, of the next draft token.
    draft_p = target_probs[:, :-1, :].gather(-1, candidates[:, 1:].long().unsqueeze(-1)).squeeze(-1)
    coins = uniform_samples[:, :-1].to(draft_p.dtype)
    ok = (draft_p > 0) & ((coins < draft_p / max(threshold_acc, 1e-9)) | (draft_p >= threshold_single))
    accepted = torch.cumprod(ok.to(torch.int64), dim=1).sum(dim=1)  # [bs]

    # Final token from relu(q - p) at the last accepted row.
    q = target_probs[rows, accepted].to(torch.float32)  # [bs, V]
    rejected = accepted < n - 1
    if bool(rejected.any()):
        rej_tok = candidates[rows, (accepted + 1).clamp(max=n - 1)].long()
        q[rows[rejected], rej_tok[rejected]] = 0.0
    cdf = torch.cumsum(q, dim=-1)
    u = uniform_samples_for_final_sampling.to(torch.float32) * cdf[:, -1]
    final = torch.searchsorted(cdf, u.unsqueeze(-1), right=True).squeeze(-1)
    # u close to 1 can land past the last positive mass: take the last token with mass.
    vocab = q.shape[-1]
    last_valid = vocab - 1 - torch.argmax((q.flip(-1) > 0).to(torch.int8), dim=-1)
    final = torch.where(final >= vocab, last_valid, final)

    base = (rows * n).view(bs, 1)
    accept_index[:bs] = torch.where(steps.view(1, n) <= accepted.view(bs, 1), base + steps, -1).to(accept_index.dtype)
    accept_token_num[:bs] = accepted.to(accept_token_num.dtype)
    flat = predicts.view(bs, n)
    nxt = torch.cat([candidates[:, 1:], candidates[:, :1]], dim=1)  # token after row j is draft j+1
    flat.copy_(torch.where(steps.view(1, n) < accepted.view(bs, 1), nxt, 0).to(predicts.dtype))
    flat[rows, accepted] = final.to(predicts.dtype)


def chain_speculative_sampling_with_draft_probs(
    predicts: torch.Tensor,  # flat: the token after each accepted row, then the final token (the kernel's layout)
    accept_index: torch.Tensor,  # [bs, n] out: flat row ids of the anchor + accepted rows
    accept_token_num: torch.Tensor,  # [bs] out: accepted draft tokens
    candidates: torch.Tensor,  # [bs, n]: anchor, then draft tokens
    retrive_index: torch.Tensor,  # [bs, n]: flat row id of each slot
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    uniform_samples: torch.Tensor,  # [bs, >= n - 1]: coin per draft token
    uniform_samples_for_final_sampling: torch.Tensor,  # [bs]
    target_probs: torch.Tensor,  # [bs, n, V]: p at each row
    draft_probs: torch.Tensor,  # [bs, n - 1, V]: q of each draft token's position
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    deterministic: bool = True,
    *,
    block_verification: bool = False,
) -> None:
    """Pure-torch version of SGLang's `chain_speculative_sampling_triton` (kernels/ops/speculative/
    reject_sampling.py, `speculative_sampling_classic_kernel`): rejection sampling of a chain drafted from q, the
    path a DFlash2 selector draws. Token-by-token: accept d_j iff q_j(d_j) is a probability and u_j * q_j(d_j) <
    p_j(d_j); at the first rejection the final token comes from relu(p - q) at that row, by inverse CDF with the
    final coin (from p itself when every draft was accepted). Exact for any q: the output is distributed as p.
    The same coins give the kernel's outputs (tests/unit/test_cpu_draft_probs_sampling.py runs both)."""
    if block_verification:
        raise NotImplementedError("block verification (speculative_use_block_verification) has no CPU sampler; "
                                  "unset it on CPU")
    bs, n = candidates.shape
    device = target_probs.device
    rows = torch.arange(bs, device=device)
    steps = torch.arange(n, device=device)
    drafts = candidates[:, 1:].long().unsqueeze(-1)  # [bs, n - 1, 1]
    p = target_probs[:, : n - 1].gather(-1, drafts).squeeze(-1).float()
    q = draft_probs[:, : n - 1].gather(-1, drafts).squeeze(-1).float()
    coins = uniform_samples[:, : n - 1].float()
    ok = (q > 0) & (q <= 1) & (coins * q < p)
    accepted = torch.cumprod(ok.to(torch.int64), dim=1).sum(dim=1)  # [bs]

    last = target_probs[rows, accepted].float()  # p at the last accepted row
    rejected = accepted < n - 1
    if bool(rejected.any()):
        q_row = draft_probs[rows, accepted.clamp(max=max(n - 2, 0))].float()
        q_row = torch.where((q_row >= 0) & (q_row <= 1), q_row, torch.zeros_like(q_row))
        residual = torch.relu(last - q_row)
        last = torch.where(rejected.view(bs, 1), residual, last)
    cdf = torch.cumsum(last, dim=-1)
    u = uniform_samples_for_final_sampling.float() * cdf[:, -1]
    # the kernel's first index whose running sum exceeds u; none (a zero residual): the last token
    final = torch.searchsorted(cdf, u.unsqueeze(-1), right=True).squeeze(-1).clamp(max=last.shape[-1] - 1)

    ridx = retrive_index[:bs].long()
    taken = steps.view(1, n) <= accepted.view(bs, 1)
    accept_index[:bs] = torch.where(taken, ridx, accept_index[:bs]).to(accept_index.dtype)
    accept_token_num[:bs] = accepted.to(accept_token_num.dtype)
    # the token after accepted row j is draft j + 1; after the last accepted row, the final token
    before = steps.view(1, n) < accepted.view(bs, 1)
    src = ridx[before]
    if n > 1:
        predicts[src] = candidates[:, 1:][before[:, : n - 1]].to(predicts.dtype)
    predicts[ridx[rows, accepted]] = final.to(predicts.dtype)
