"""A ragged step (per-request widths, CPU): request i drafts and verifies the first ``decision.widths[i]``
positions of its window -- what a width-widths[i] step would run for it -- in one draft and one verify forward of
sum(widths) rows (cpu/attention.py RaggedBlock). The accept runs on the padded [bs, W] layout (W the widest): the
target's token at every verified row (its argmax, or a sample of plain decoding's distribution there:
accept.target_choices), and a padded candidate is -1, which no token equals, so request i accepts at most
widths[i] - 1 drafts and its bonus is the target's token at a row it verified -- at any temperature the committed
tokens are the target's own, one after another. Every row's logits are first adjusted as plain decoding would
adjust them after the tokens before it: penalties replayed per row (verify_rows.py, on the padded layout) and
logit_bias; logprobs are then reported from those rows as a chain step reports them."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import sglang.srt.speculative.dflash_worker_v2 as upstream
import torch

from sglang_ext import verify_rows
from sglang_ext.controller_loop import LaunchedStep
from sglang_ext.cpu.attention import RaggedBlock
from sglang_ext.patches.verify_sampling import ORCHESTRATOR
from sglang_ext.steps.accept import accept_chain, target_choices
from sglang_ext.steps.context import StepContext
from sglang_ext.steps.draft import draft_forward
from sglang_ext.steps.verify import published, step_result, target_hidden, verify_forward
from sglang_ext.steps.window import block_window

if TYPE_CHECKING:
    from sglang.srt.managers.utils import GenerationBatchResult

    from sglang_ext.steps.upstream_surface import StepWorker


def ragged_serves(worker: StepWorker, batch: Any) -> bool:
    """Whether this batch's step may verify a width per request: on CPU (the torch attention reads the ragged
    layout; GPU verify graphs are per width), greedy or sampled, with penalties, logit_bias or logprobs (each row
    is adjusted and reported as a chain's row of its request is: ``decode_ragged``). Refused, the step verifying
    one width: a grammar (its vocabulary mask is built for a [bs, n] chain of candidates: upstream's
    ``GrammarTree.from_linear_chain``, which a padded -1 candidate would walk), a custom logit processor (upstream
    calls it on the [bs * n] rows of one width, ``num_tokens_in_batch``, not on rows of uneven requests) and a
    sampling mask (captured from a [bs, n] block's logits)."""
    if not worker._prefix_drafts or upstream.is_cuda() or batch.has_grammar:
        return False
    si = batch.sampling_info
    return si is None or not (si.has_custom_logit_processor or si.sampling_mask_batch_indices is not None)


def decode_ragged(ctx: StepContext) -> GenerationBatchResult:
    w, bs = ctx.worker, ctx.bs
    w.draft_kv.flush()  # the draft reads its KV: it must hold every committed token
    W = int(ctx.decision.block_size)
    lens = torch.tensor(ctx.decision.widths, dtype=torch.int64, device=w.device)
    ragged = RaggedBlock.of(lens, W)
    window = block_window(ctx)
    # the ragged rows as a flat index into the [bs, B] window (KVLocPlan cols)
    cols = (ragged.rows // W) * w.max_block + ragged.rows % W
    drafted = draft_forward(ctx, window, W, ragged=ragged, cols=cols).tokens  # [bs, W - 1], -1 past each width
    cand = torch.cat([ctx.draft_input.bonus_tokens.view(bs, 1).to(torch.int64), drafted], dim=1)
    positions = window.positions[:, :W].reshape(-1).index_select(0, ragged.rows)
    target_out, target_predict = verify_forward(ctx, window, cand, positions, ragged=ragged, cols=cols)
    logits_output = target_out.logits_output
    logits = logits_output.next_token_logits
    si = ctx.batch.sampling_info
    orchestrator = None if si is None else getattr(si, ORCHESTRATOR, None)
    if logits is not None and verify_rows.active_penalizers(orchestrator):
        # row j of request i: the penalties plain decoding reaches after its anchor and first j drafts, replayed on
        # the padded layout; a padded candidate takes the anchor's token (any token would do: its rows are dropped,
        # and a row before it reads only the tokens before that row)
        padded = ragged.pad(logits).view(bs, W, -1)
        verify_rows.apply_row_penalties(padded, torch.where(cand < 0, cand[:, :1], cand), orchestrator)
        logits = padded.view(bs * W, -1).index_select(0, ragged.rows)
    # the target's token at every packed row (logit_bias added in place; greedy with nothing applied: upstream's
    # argmax of them), padded to [bs, W]: a padded row's 0 follows a -1 candidate, so it is never committed
    choice = target_choices(ctx, logits, target_predict, W, rows_of=ragged.rows // W)
    predict = ragged.pad(choice).view(bs, W)
    accept_len, commit_lens, bonus, out_tokens, new_seq_lens = accept_chain(ctx, cand, None, predict,
                                                                            window.prefix_lens)
    out_tokens.clamp_(min=0)  # past each commit length: a padded candidate's -1, read by nothing
    if ctx.batch.return_logprob:  # the adjusted rows, padded to a width-W chain's layout (padded rows: not read)
        logits_output.next_token_logits = ragged.pad(logits)
        upstream.compute_spec_logprobs(ctx.batch, logits_output, out_tokens.reshape(-1), chain_stride=W)
    new_seq_lens = published(ctx, window.prefix_lens, commit_lens, new_seq_lens)
    hidden = target_hidden(logits_output)
    cache_loc = window.plan.write_ids(w.draft_model_runner.kv_index_translator, cols=slice(0, W))
    w.draft_kv.append(ragged.pad(hidden).view(bs, W, -1), cache_loc.view(bs, W), window.positions[:, :W],
                      commit_lens)
    logits_output.hidden_states = None
    logits_output.next_token_logits = None  # the packed rows' logits: nothing downstream reads them
    committed = out_tokens.view(bs, W).to("cpu", non_blocking=True)
    w.loop.launched(LaunchedStep(ctx.rids, ctx.decision, None, committed))
    return step_result(ctx, target_out, out_tokens, commit_lens, bonus, new_seq_lens, W)
