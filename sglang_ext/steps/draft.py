"""The draft forward of a decode step: upstream's drafter over the first ``width`` positions of the step's window."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import sglang.srt.speculative.dflash_worker_v2 as upstream
import torch

from sglang_ext.cpu.attention import RaggedBlock
from sglang_ext.patches.cpu_layer import RAGGED_ATTR
from sglang_ext.steps.context import StepContext, block_size_as
from sglang_ext.steps.window import StepWindow, host_kv_bound
from sglang_ext.tree.marginals import top_log_probs


@dataclass(frozen=True)
class Draft:
    """A draft forward's proposals: the greedy tokens [bs, width - 1] (-1 past a ragged request's width) and, when
    marginals were asked for, the top-k log-probabilities and their tokens [bs, width - 1, k] (``tokens`` is then
    the top-1). A DFlash2 drafter's sampled path carries its q in ``selector_q`` (candidate ids and their
    probabilities per drafted position, [bs, width - 1, k] each): upstream's accept rejection-samples against it."""

    tokens: torch.Tensor
    log_probs: torch.Tensor | None = None
    top: torch.Tensor | None = None
    selector_q: tuple[torch.Tensor, torch.Tensor] | None = None


def draft_forward(ctx: StepContext, window: StepWindow, width: int, marginals_k: int = 0,
                  ragged: RaggedBlock | None = None, cols: torch.Tensor | None = None) -> Draft:
    """Upstream's draft forward over the first ``width`` positions of the window (the full block B, or a prefix
    with prefix drafts); with ``marginals_k``, the top-k marginals of those positions too (a tree step's input, from
    the same one forward). ``ragged`` (``cols``: its rows in the window): request i drafts its first
    ragged.lens[i] positions only."""
    w, batch, bs = ctx.worker, ctx.batch, ctx.bs
    full = width == w.max_block
    spec_info = w._draft_spec_info_by_width.get(width) if ragged is None else None
    if ragged is not None:  # this step's own: it carries the layout to the attention (cpu_layer.RAGGED_ATTR)
        spec_info = upstream.make_draft_block_spec_info(draft_token_num=width, device=w.device)
        setattr(spec_info, RAGGED_ATTR, ragged)
    elif spec_info is None:
        spec_info = w._draft_spec_info_by_width[width] = upstream.make_draft_block_spec_info(
            draft_token_num=width, device=w.device)
    target_model = w.target_worker.model_runner.model
    embed = upstream.unwrap_lora_layer(upstream._resolve_dflash_embedding_module(w.draft_model, target_model))
    lm_head = upstream.unwrap_lora_layer(getattr(target_model, "lm_head", None))
    block_ids = window.block_ids if full else window.block_ids[:, :width].contiguous()
    rows = bs * width
    positions = window.positions[:, :width].reshape(-1)
    if ragged is not None:
        block_ids = block_ids.reshape(-1).index_select(0, ragged.rows)
        positions = positions.index_select(0, ragged.rows)
        rows = int(ragged.rows.shape[0])
    if w._full_embed_gpu is not None:
        noise = torch.nn.functional.embedding(block_ids, w._full_embed_gpu)
    else:
        noise = embed(block_ids)
    if w._noise_embed_scale != 1.0:
        noise = noise * w._noise_embed_scale
    seq_lens_cpu = w._draft_seq_lens_cpu_buf[:bs]
    lens, lens_sum = host_kv_bound(ctx, width)
    seq_lens_cpu.copy_(lens)
    forward_batch = upstream.ForwardBatch(
        forward_mode=upstream.ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=block_ids.flatten(),
        req_pool_indices=batch.req_pool_indices, seq_lens=window.prefix_lens,
        out_cache_loc=window.cache_loc[:, :width].reshape(-1) if ragged is None else None,
        seq_lens_sum=lens_sum, seq_lens_cpu=seq_lens_cpu,
        positions=positions, input_embeds=noise.view(-1, noise.shape[-1]),
        spec_algorithm=upstream.SpeculativeAlgorithm.DFLASH, spec_info=spec_info,
        capture_hidden_mode=upstream.CaptureHiddenMode.NULL,
        num_token_non_padded=(torch.full((), rows, dtype=torch.int32, device=w.device)
                              if upstream.enable_num_token_non_padded() else None),
        global_num_token_non_padded_cpu=rows,
        can_run_decode_cuda_graph=batch.can_run_decode_cuda_graph and ragged is None)
    window.plan.bind(forward_batch, w.draft_model_runner.kv_index_translator,
                     cols=cols if ragged is not None
                     else None if window.cache_loc.shape[1] == width else slice(0, width))
    if w.selector is not None and w._draft_sampler is not None:  # read by the draft graph's in-graph walk
        w._draft_sampler.stage_sampling_params(bs=bs, sampling_info=batch.sampling_info)
    with torch.inference_mode(), upstream.draft_tp_context(w.draft_parallel_layout), conv_block_as(w.draft_model,
                                                                                                  width):
        out = w.draft_model_runner.forward(forward_batch)
    if w.selector is not None:  # trees and ragged steps are refused for DFlash2 drafters (worker.py)
        return selector_path(ctx, out, width, block_ids[:, 0], lm_head)
    if w._draft_sampler is not None and out.can_run_graph and not marginals_k:
        return Draft(w._draft_sampler.out[: bs * (width - 1)].view(bs, width - 1))  # the greedy head, in the graph
    # (a tree step's marginals read the hidden states: the draft graph outputs them, its head is folded after)
    hidden = out.logits_output.hidden_states
    if hidden is None:
        raise RuntimeError("DFLASH draft model returned no hidden states.")
    if ragged is not None:
        drafted = ragged.rows % width != 0  # every row but the anchors
        with upstream.draft_tp_context(w.draft_parallel_layout):
            greedy = w._greedy_sample_from_vocab_parallel_head(hidden_states=hidden[drafted], lm_head=lm_head)
        out_tokens = torch.full((bs * width,), -1, dtype=torch.int64, device=hidden.device)
        out_tokens[ragged.rows[drafted]] = greedy.view(-1).to(torch.int64)
        return Draft(out_tokens.view(bs, width)[:, 1:])
    hidden = hidden.view(bs, width, -1)
    if marginals_k:
        log_probs, top = marginals(hidden[:, 1:, :], lm_head, marginals_k)
        return Draft(top[:, :, 0], log_probs, top)
    with upstream.draft_tp_context(w.draft_parallel_layout):
        return Draft(w._greedy_sample_from_vocab_parallel_head(
            hidden_states=hidden[:, 1:, :].reshape(-1, hidden.shape[-1]), lm_head=lm_head).view(bs, width - 1))


def selector_path(ctx: StepContext, out: Any, width: int, anchors: torch.Tensor, lm_head: Any) -> Draft:
    """A DFlash2 drafter's proposal [bs, width - 1]: its candidate selector's walk through the target head's top-k
    at each drafted position -- upstream's own (the walk inside the draft CUDA graph, or `_propose_selector_block`
    eagerly): the argmax path for greedy rows, a sampled one for sampled rows, whose q (candidates and
    probabilities per position) the draft carries for the accept's rejection sampling (``Draft.selector_q``)."""
    w, bs = ctx.worker, ctx.bs
    if w._draft_sampler is not None and out.can_run_graph:  # GPU, the full block the graph was captured for
        sampler = w._draft_sampler
        q = None
        if w._selector_sampling_enabled and not upstream._is_all_greedy(ctx.batch.sampling_info):
            q = (sampler.candidate_out[:bs], sampler.q_out[:bs])
        return Draft(sampler.out[: bs * (width - 1)].view(bs, width - 1), selector_q=q)
    with block_size_as(w, width), upstream.draft_tp_context(w.draft_parallel_layout):
        tokens = w._propose_selector_block(draft_logits_output=out.logits_output, bs=bs, lm_head=lm_head,
                                           anchor_token_ids=anchors, sampling_info=ctx.batch.sampling_info)
    # upstream leaves a sampled path's q on the worker: taken into the draft, so no later step reads it there
    q, w._selector_sample = w._selector_sample, None
    return Draft(tokens, selector_q=q)


@contextlib.contextmanager
def conv_block_as(draft_model: Any, width: int):
    """DFlash2's grouped convolutions (models/dflash.py DFlashGroupedConv) find each row's position in its block as
    the row index modulo their ``block_size``: a prefix draft of ``width`` rows a request needs that width there.
    Nothing to do for a DFlash drafter (no convolutions) or at the trained block."""
    convs = [c for layer in getattr(draft_model, "layers", ())
             for c in (getattr(layer, "attention_conv", None), getattr(layer, "mlp_conv", None)) if c is not None]
    saved = [c.block_size for c in convs]
    for c in convs:
        c.block_size = width
    try:
        yield
    finally:
        for c, b in zip(convs, saved):
            c.block_size = b


def marginals(hidden: torch.Tensor, lm_head: Any, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's top-``k`` log-probabilities and tokens at every drafted position ([bs, D, k] each, sorted
    descending): the same LM head the greedy draft takes its argmax from (tensor parallel 1: refused otherwise at
    start-up), over the vocabulary without its padding rows."""
    weight = lm_head.weight
    shard = getattr(lm_head, "shard_indices", None)
    if shard is not None:
        weight = weight[: int(shard.num_org_elements)]
    return top_log_probs(torch.matmul(hidden.to(weight.dtype), weight.T), k)
