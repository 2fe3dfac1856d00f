"""A DDTree step (a candidate width n > B; docs/DDTREE.md): one full draft forward whose top-k marginals give the
n - 1 most likely prefixes (tree/build.py); root (the anchor) + n - 1 nodes verified at positions prefix + depth
under the ancestor mask, in the layout GPU attention reads (tree/mask.py packed; the CPU attention unpacks it); the
target's choice at every node walked from the root (tree/walk.py: greedy or sampled, lossless either way); the
window's req_to_token entries reordered so the committed path's KV sits at the committed positions
(tree/commit.py: no K/V copy) and the path's features appended to the draft KV. The path goes back to the
controller, which learns from it what every narrower tree would have committed (controller/tree_gain.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from sglang_ext import verify_rows
from sglang_ext.controller_loop import LaunchedStep
from sglang_ext.patches.verify_sampling import ORCHESTRATOR
from sglang_ext.steps.accept import target_choices
from sglang_ext.steps.context import StepContext
from sglang_ext.steps.draft import draft_forward
from sglang_ext.steps.verify import published, step_result, target_hidden, verify_forward
from sglang_ext.steps.window import host_kv_bound, wide_window
from sglang_ext.tree.build import build_trees
from sglang_ext.tree.commit import window_order
from sglang_ext.tree.mask import ancestor_mask, packed
from sglang_ext.tree.mask import positions as tree_positions
from sglang_ext.tree.walk import walk

if TYPE_CHECKING:
    from sglang.srt.managers.utils import GenerationBatchResult

# a tree step's top-k per drafted position: k = budget keeps build_trees exact (any tree shape) up to this
TREE_TOP_K = 16


def tree_serves(batch: Any) -> bool:
    """Whether this batch's step may verify a tree: nothing in it depends on the candidates being one chain --
    grammars (a chain's token tree), logprobs (reported per chain row), per-row penalties (replayed along the
    chain), custom logit processors and sampling masks. Such a batch verifies the chain this step."""
    si = batch.sampling_info
    if batch.has_grammar or batch.return_logprob:
        return False
    if si is None:
        return True
    # the forward's copy carries the scheduler's orchestrator aside (patches/verify_sampling.py); the scheduler's
    # own batch (a decision taken at decode preparation) has it in place
    orchestrator = getattr(si, ORCHESTRATOR, None) or si.penalizer_orchestrator
    return not (si.has_custom_logit_processor or si.sampling_mask_batch_indices is not None
                or verify_rows.active_penalizers(orchestrator))


def decode_tree(ctx: StepContext) -> GenerationBatchResult:
    w, batch, bs = ctx.worker, ctx.batch, ctx.bs
    w.draft_kv.flush()
    n, B = ctx.decision.block_size, w.max_block
    window = wide_window(ctx, n)
    draft = draft_forward(ctx, window, B, marginals_k=min(n - 1, TREE_TOP_K))
    trees = build_trees(draft.log_probs, draft.top, n - 1)
    drafted = draft.tokens.to("cpu", non_blocking=True)  # the greedy block: hindsight's evidence, as a chain
    cand = torch.cat([ctx.draft_input.bonus_tokens.view(bs, 1).to(torch.int64), trees.token], dim=1)  # [bs, n]
    positions = tree_positions(window.prefix_lens, trees.depth).reshape(-1)
    mask = ancestor_mask(trees.parent)
    # the layout GPU attention reads, on every device (the CPU attention unpacks it); sized from the host's
    # bound of the KV lengths the verify runs with (no device sync), less the window
    prefix_sum = host_kv_bound(ctx, n)[1] - bs * n
    target_out, target_predict = verify_forward(ctx, window, cand, positions,
                                                tree_mask=packed(mask, window.prefix_lens, prefix_sum))
    logits_output = target_out.logits_output
    choice = target_choices(ctx, logits_output.next_token_logits, target_predict, n)
    accepted, path, bonus = walk(trees, choice, depth=B - 1, mask=mask)
    order = window_order(path, n)
    commit_lens = (accepted + 1).to(torch.int32)
    ordered = cand.gather(1, order)  # root, the path's tokens, then the rest
    out_tokens = torch.cat([ordered[:, 1:], ordered[:, :1]], dim=1)
    out_tokens.scatter_(1, accepted.unsqueeze(1), bonus.unsqueeze(1))  # the path's tokens, then the bonus
    stride = B  # the scheduler's row stride: a path is at most B - 1 deep, so B columns hold a commit
    out_tokens = out_tokens[:, :stride].contiguous()
    # the committed positions prefix .. prefix + accepted take their nodes' slots (no K/V copy)
    req_to_token = w.model_runner.req_to_token_pool.req_to_token
    rows = batch.req_pool_indices.to(torch.int64).unsqueeze(1)
    cols = window.prefix_lens.to(torch.int64).unsqueeze(1) + torch.arange(n, device=order.device)
    req_to_token[rows, cols] = window.cache_loc[:, :n].gather(1, order).to(req_to_token.dtype)
    new_seq_lens = published(ctx, window.prefix_lens, commit_lens, None)
    hidden = target_hidden(logits_output).view(bs, n, -1)
    hidden = hidden.gather(1, order.unsqueeze(2).expand(bs, n, hidden.shape[-1]))
    draft_loc = window.plan.write_ids(w.draft_model_runner.kv_index_translator, cols=slice(0, n))
    draft_loc = draft_loc.view(bs, n).gather(1, order)
    w.draft_kv.append(hidden, draft_loc, window.positions[:, :n], commit_lens)
    logits_output.hidden_states = None
    result = step_result(ctx, target_out, out_tokens, commit_lens, bonus, new_seq_lens, stride)
    w.loop.launched(LaunchedStep(ctx.rids, ctx.decision, drafted, out_tokens.to("cpu", non_blocking=True),
                                 tree_path=path.to("cpu", non_blocking=True)))
    return result
