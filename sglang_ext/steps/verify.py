"""The target's verify forward of a decode step, and what every step kind hands SGLang after its accept."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import sglang.srt.speculative.dflash_worker_v2 as upstream
import torch

from sglang_ext.cpu.attention import RaggedBlock
from sglang_ext.patches.cpu_layer import RAGGED_ATTR
from sglang_ext.steps.accept import accept_chain, accept_width1
from sglang_ext.steps.context import StepContext
from sglang_ext.steps.window import StepWindow, host_kv_bound

if TYPE_CHECKING:
    from sglang.srt.managers.utils import GenerationBatchResult


def verify_forward(ctx: StepContext, window: StepWindow, cand: torch.Tensor, positions: torch.Tensor,
                   tree_mask: torch.Tensor | None = None, ragged: RaggedBlock | None = None,
                   cols: torch.Tensor | None = None) -> tuple[Any, torch.Tensor | None]:
    """The target's verify forward of [bs, n] candidates written to the first n slots of the window, at
    ``positions``, then the logit adjustments every accept applies (custom logit processors, grammar) ->
    (target_out, target_predict: its argmax when upstream skipped the full logits, else None). ``tree_mask``
    (the ancestor mask, tree/mask.py packed): a tree verify (the grammar is a chain's; tree steps never have one).
    ``ragged`` (``cols``: its rows in the window): the packed rows of ``cand`` only, at packed ``positions``
    (steps/ragged.py: greedy, nothing applied to the logits)."""
    w, batch, draft_input = ctx.worker, ctx.batch, ctx.draft_input
    n = int(cand.shape[1])
    grammar_tree = upstream.GrammarTree.from_linear_chain(cand) if batch.has_grammar else None
    draft_token, write = cand.reshape(-1), slice(0, n)
    if ragged is not None:
        draft_token, write = draft_token.index_select(0, ragged.rows), cols
    verify_input = upstream.DFlashVerifyInput(
        draft_token=draft_token, positions=positions, draft_token_num=n, custom_mask=tree_mask,
        capture_hidden_mode=upstream.CaptureHiddenMode.FULL, kv_loc_plan=window.plan, kv_loc_cols=write)
    if ragged is not None:
        setattr(verify_input, RAGGED_ATTR, ragged)
    batch.out_cache_loc = (window.cache_loc[:, :n].reshape(-1) if ragged is None
                           else window.cache_loc.reshape(-1).index_select(0, cols))
    sampling_info = batch.sampling_info
    saved = batch.seq_lens_cpu, batch.seq_lens_sum
    if batch.seq_lens_cpu is not None or draft_input.nxt_kv_lens_cpu is not None:
        batch.seq_lens_cpu, batch.seq_lens_sum = host_kv_bound(ctx, n)
    verify_batch, _ = verify_input.prepare_for_verify(batch, w.target_worker, defer_metadata_init=False)
    batch.seq_lens_cpu, batch.seq_lens_sum = saved
    target_out = w.target_worker.forward_batch_generation(
        batch=None, forward_batch=verify_batch, is_verify=True,
        skip_attn_backend_init=None if upstream._is_npu else True)
    logits_output = target_out.logits_output
    target_predict = None
    lp = w._target_logits_processor
    if lp is not None and lp.is_deferred_shard(logits_output.next_token_logits):
        if w._can_skip_verify_logits(batch, sampling_info):
            target_predict = lp.deferred_argmax(logits_output.next_token_logits)
            logits_output.next_token_logits = None
        else:
            logits_output.next_token_logits = lp.finish_deferred_gather(logits_output.next_token_logits)
    grammar_mask = None
    if batch.has_grammar:
        grammar_mask = upstream.build_grammar_vocab_mask(
            reqs=batch.reqs, tree=grammar_tree, sampling_info=sampling_info,
            device=logits_output.next_token_logits.device, barrier=ctx.grammar_barrier)
    if sampling_info is not None and target_predict is None:
        upstream.apply_dflash_verify_logits_adjustments(
            next_token_logits=logits_output.next_token_logits, sampling_info=sampling_info, draft_token_num=n)
    if grammar_mask is not None:
        grammar_mask.apply(logits_output.next_token_logits)
    return target_out, target_predict


def verify_chain(ctx: StepContext, window: StepWindow, cand: torch.Tensor, b: int,
                 defer_append: bool = False) -> GenerationBatchResult:
    """Target verify of [bs, b] chain candidates, accept, and the draft-KV append (upstream's, at width b; kept for
    a batched pass when ``defer_append``, width 1 only: one committed token per request) -> SGLang's result."""
    w, batch, bs = ctx.worker, ctx.batch, ctx.bs
    positions = window.positions[:, :b].reshape(-1)
    sampling_info = batch.sampling_info
    hybrid = w._need_mamba_verify_commit
    seq_lens_pre_verify = batch.seq_lens.clone() if hybrid else None
    target_out, target_predict = verify_forward(ctx, window, cand, positions)
    logits_output = target_out.logits_output
    accept = accept_width1 if b == 1 else accept_chain
    accept_len, commit_lens, bonus, out_tokens, new_seq_lens = accept(
        ctx, cand, logits_output.next_token_logits, target_predict, window.prefix_lens)
    if hybrid:  # the verify wrote each position's recurrent state aside: keep the accepted prefix's last
        w._update_target_mamba_state_after_verify(
            batch=batch, seq_lens_pre_verify=seq_lens_pre_verify,
            seq_lens_post_verify=(new_seq_lens if new_seq_lens is not None
                                  else window.prefix_lens + commit_lens.to(window.prefix_lens.dtype)),
            commit_lens=commit_lens)
    mask_capture = upstream.SpeculativeSamplingMaskCapture.from_logits(
        sampling_info, next_token_logits=logits_output.next_token_logits, draft_input=ctx.draft_input,
        draft_token_num=b, bs=bs)
    if mask_capture is not None:
        logits_output.sampling_mask_output = mask_capture.build_output(out_tokens=out_tokens,
                                                                       commit_lens=commit_lens)
    if batch.return_logprob:
        upstream.compute_spec_logprobs(batch, logits_output, out_tokens.reshape(-1), chain_stride=b)
    new_seq_lens = published(ctx, window.prefix_lens, commit_lens, new_seq_lens)
    hidden = target_hidden(logits_output).view(bs, b, -1)
    cache_loc = window.plan.write_ids(w.draft_model_runner.kv_index_translator, cols=slice(0, b))
    if defer_append:
        w.draft_kv.defer(hidden.reshape(bs, -1), cache_loc.reshape(-1), positions, batch.reqs)
    else:
        w.draft_kv.append(hidden, cache_loc.view(bs, b), positions.view(bs, b), commit_lens)
    logits_output.hidden_states = None
    return step_result(ctx, target_out, out_tokens, commit_lens, bonus, new_seq_lens, b)


def published(ctx: StepContext, prefix_lens: torch.Tensor, commit_lens: torch.Tensor,
              new_seq_lens: torch.Tensor | None) -> torch.Tensor:
    """The committed lengths after the step (the accept's, or prefix + commit), handed to SGLang's ``on_publish``."""
    if new_seq_lens is None:
        new_seq_lens = prefix_lens + commit_lens.to(prefix_lens.dtype)
    if ctx.on_publish is not None:
        ctx.on_publish(new_seq_lens)
    return new_seq_lens


def target_hidden(logits_output: Any) -> torch.Tensor:
    hidden = logits_output.hidden_states
    if hidden is None:
        raise RuntimeError("DFLASH verify requires target hidden states, but got None.")
    return hidden


def step_result(ctx: StepContext, target_out: Any, out_tokens: torch.Tensor, commit_lens: torch.Tensor,
                bonus: torch.Tensor, new_seq_lens: torch.Tensor, stride: int) -> GenerationBatchResult:
    """The step's result for the scheduler: ``out_tokens`` [bs, stride] (its row stride of next_token_ids),
    each row's first commit_lens[i] committed."""
    return upstream.GenerationBatchResult(
        logits_output=target_out.logits_output, next_token_ids=out_tokens.reshape(-1), accept_lens=commit_lens,
        can_run_cuda_graph=target_out.can_run_cuda_graph,
        next_draft_input=ctx.worker._make_next_draft_input_decode(bonus_tokens=bonus, new_seq_lens=new_seq_lens),
        speculative_num_draft_tokens=stride, new_seq_lens=new_seq_lens,
        routed_experts_output=target_out.routed_experts_output,
        indexer_topk_output=target_out.indexer_topk_output)
