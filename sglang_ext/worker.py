"""AdaptiveDFlashWorker: upstream's DFlash worker with a verify width chosen every decode step.

Each decode step:
  1. the controller picks the verify width b from the batch (``decide``), identically on every TP rank;
  2. the drafter runs over its full trained block B (upstream's draft model, draft attention and draft CUDA graph),
     or -- with prefix drafts, where the draft runs eagerly (CPU) -- over the first b positions only, as upstream's
     block-b DFlash does: positions < b then attend to b - 1 mask tokens, not B - 1. At b = 1 the draft forward is
     skipped. The controller's periodic probes draft the full block at any b < B (so hindsight keeps observing the
     positions a narrower width does not draft). Why prefix drafts: the draft forward is compute on CPU, and a
     full-block draft made width 8 cost nearly width 16 (41.4 vs upstream block 8's 36.2 ms at 16 requests:
     benchmarks/results/step_profile_cpu.md). GPU keeps the full block: its draft CUDA graph is captured for B
     (a graph per width would retire that difference);
  3. the target verifies the prefix [anchor, d_1 .. d_{b-1}] (TARGET_VERIFY at width b, its KV written to the
     first b slots of the step's window);
  4. the target's hidden states of the committed tokens are appended to the draft KV cache, so the draft context
     stays current. At b = 1 without a draft ("speculation off") the step is a decode step: one KV slot, not the
     B-slot window, and the append is deferred -- the committed token's target features are kept and written in
     one batched pass before anything can read the draft KV (the next draft, any non-decode forward), before a
     request leaves the batch (its slots may be handed on), or after DEFERRED_APPEND_STEPS steps. The draft KV is
     then exactly what per-step appends would have written, so acceptance after drafting resumes is what it would
     have been had drafting never paused.
  5. DDTree (a candidate width w > B): the step verifies a tree of N = w - 1 nodes instead of a chain -- one
     full draft forward, its top-k marginals at every position (sglang_ext/tree/build.py: the N most likely
     prefixes), root (the anchor) + N nodes verified at positions prefix + depth under the ancestor mask
     (DFlashVerifyInput.custom_mask in the layout GPU attention reads, tree/mask.py packed, which the CPU attention
     unpacks; on GPU FlashInfer or Triton read it, from a verify graph per tree width, verify_runtimes.py), the
     target's choice at every node walked from the root (tree/walk.py: greedy or sampled, lossless either way),
     then the window's req_to_token entries reordered so the committed path's KV sits at the committed positions
     (tree/commit.py: no K/V copy) and the path's target features appended to the draft KV; the path goes back to
     the controller, which learns from it what every narrower tree would have committed (controller/tree_gain.py).
     Batches a tree cannot serve (grammar, logprobs, per-row penalties, custom logit processors, sampling masks)
     are decided without trees.
KV reservations stay sized for B: the scheduler reserves 2 * B slots per request per step before the worker
runs (dflash_info_v2.prepare_for_decode), and every buffer sized by upstream for B is sliced, never re-sized. A
tree of 1 + N > B nodes has its own window and a reserve widened for it (patches/dflash_headroom.py).

This module is the tensor path only. The bookkeeping around it -- the decision, pending steps, step times,
feedback to the controller and Prometheus -- is controller_loop.py's (no torch, no SGLang). Feedback needs no
device sync: the step's drafted block and committed tokens are copied to the host asynchronously; SGLang calls
``on_verify_complete_cpu`` after its own copy-done sync, in launch order, and the loop reads them then.

Supported drafters: plain DFlash (z-lab format). Heads that propose differently (selector, LiLiCorr, Domino), a
draft sliding window and hybrid (mamba) targets are refused at start-up with the fix (serve with ``dflash``).
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

import sglang.srt.speculative.dflash_utils as dflash_utils
import sglang.srt.speculative.dflash_worker_v2 as upstream
from sglang.srt.layers.sampler import sampling_from_probs_torch
from sglang.srt.runtime_context import get_schedule
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

from sglang_ext import names, refusals, verify_rows
from sglang_ext.controller.policy import Decision, calibrated_widths
from sglang_ext.controller_loop import ControllerLoop, LaunchedStep
from sglang_ext.cpu.attention import RaggedBlock
from sglang_ext.patches.cpu_layer import RAGGED_ATTR
from sglang_ext.patches.verify_sampling import ORCHESTRATOR
from sglang_ext.settings import AdaptiveSettings, adaptive_settings
from sglang_ext.tree.build import build_trees
from sglang_ext.tree.commit import window_order
from sglang_ext.tree.marginals import top_log_probs
from sglang_ext.tree.mask import ancestor_mask, packed
from sglang_ext.tree.mask import positions as tree_positions
from sglang_ext.tree.walk import walk
from sglang_ext.verify_runtimes import VerifyRuntimes, capture_verify_runtimes, tree_verify_refusal

logger = logging.getLogger(__name__)
# width-1 steps whose draft-KV appends are batched into one pass: bounds the features held (bs x D per step)
DEFERRED_APPEND_STEPS = 16
# a tree step's top-k per drafted position: k = budget keeps build_trees exact (any tree shape) up to this
TREE_TOP_K = 16


@dataclass(frozen=True)
class StepWindow:
    """The step's KV window: B slots per request past its committed prefix (upstream's block preparation)."""

    block_ids: torch.Tensor | None  # [bs, B]: the anchor, then mask tokens (the draft's input); None at width 1
    positions: torch.Tensor  # [bs, B]
    cache_loc: torch.Tensor  # [bs, B] KV slots
    plan: object  # kv_index_translator plan: binds the draft and verify forwards to the window
    prefix_lens: torch.Tensor  # [bs] committed lengths


@dataclass(frozen=True)
class DeferredAppend:
    """One width-1 step's draft-KV append, not yet written: the committed token's target features and where the
    draft KV keeps them (draft-pool ids and positions). Width 1 commits exactly one token per request."""

    hidden: torch.Tensor  # [bs, D]
    cache_loc: torch.Tensor  # [bs] draft-pool KV slots
    positions: torch.Tensor  # [bs]


def _published(prefix_lens: torch.Tensor, commit_lens: torch.Tensor, new_seq_lens: torch.Tensor | None,
               on_publish) -> torch.Tensor:
    """The committed lengths after the step (the accept's, or prefix + commit), handed to SGLang's ``on_publish``."""
    if new_seq_lens is None:
        new_seq_lens = prefix_lens + commit_lens.to(prefix_lens.dtype)
    if on_publish is not None:
        on_publish(new_seq_lens)
    return new_seq_lens


def _target_hidden(logits_output) -> torch.Tensor:
    hidden = logits_output.hidden_states
    if hidden is None:
        raise RuntimeError("DFLASH verify requires target hidden states, but got None.")
    return hidden


def _sampled(batch) -> list[bool] | None:
    """Which requests sample (the controller's prior class); None when all are greedy. Host-side: SGLang turns
    temperature 0 into top_k 1, and ``is_all_greedy`` is a host flag of the batch's sampling info."""
    si = batch.sampling_info
    if si is None or si.is_all_greedy:
        return None
    return [req.sampling_params.top_k > 1 for req in batch.reqs]


class AdaptiveDFlashWorker(DFlashWorkerV2):
    def __init__(self, server_args, gpu_id, nccl_port, target_worker) -> None:
        super().__init__(server_args, gpu_id, nccl_port, target_worker)
        self._refuse_unsupported()
        self.max_block = int(self.block_size)  # the trained block B; self.block_size is upstream's and stays B
        settings = adaptive_settings()  # built and validated by the launcher
        parallel = upstream.get_parallel()
        rank, group = int(parallel.tp_rank), parallel.tp_group
        # see the module docstring, step 2
        self._prefix_drafts = torch.device(self.device).type == "cpu" and os.environ.get(names.FULL_DRAFTS) != "1"
        metrics = None
        if getattr(server_args, "enable_metrics", False) and rank == 0:
            from sglang_ext.metrics import DFlashMetrics

            cands = settings.controller.candidates_for(self.max_block)
            metrics = DFlashMetrics(server_args.served_model_name or server_args.model_path, self.max_block, cands,
                                    calibrated=calibrated_widths(cands, self.max_block, self._prefix_drafts))
        self._compact_appends = torch.device(self.device).type == "cpu"  # see _append_committed
        self._draft_spec_info_by_width = {self.max_block: self._draft_block_spec_info}
        try:
            self.loop = ControllerLoop(settings, self.max_block, is_rank0=rank == 0, metrics=metrics,
                                       broadcast=(lambda obj: group.broadcast_object(obj, src=0))
                                       if group.world_size > 1 else None,
                                       overlap=not get_schedule().disable_overlap_schedule,
                                       prefix_drafts=self._prefix_drafts)
        except ValueError as e:  # the preflight's rule, for a server started without dflash-serve
            raise ValueError(f"DFLASH_ADAPTIVE speculative.adaptive.{e}") from None
        self._verify_runtimes = VerifyRuntimes.eager(self.model_runner)
        self._trees = self._checked_trees(settings, int(group.world_size))
        self._ragged = settings.controller.per_request_widths  # checked per step only when on (_ragged_serves)
        why = refusals.per_request_widths_refusal(torch.device(self.device).type) if self._ragged else None
        if why is not None:
            raise ValueError(f"DFLASH_ADAPTIVE speculative.adaptive.per_request_widths: {why}")
        self._deferred: list[DeferredAppend] = []
        self._deferred_rids: list[str] = []  # the batch the deferred appends were taken from
        self._defer_width1_append = os.environ.get(names.EAGER_APPEND) != "1"
        if os.environ.get(names.TRITON_ON_CPU) == "1":
            self._take_triton_branches_on_cpu()
        if rank == 0:
            logger.info("dflash-serve DFLASH_ADAPTIVE: block %d, candidates %s, mode %s, cost profile %s",
                        self.max_block, self.loop.candidates, settings.controller.mode,
                        settings.cost_profile or "packaged roofline")

    @property
    def controller(self):
        return self.loop.controller

    def _refuse_unsupported(self) -> None:
        fix = "serve this pair with speculative.algorithm: dflash"
        if self.selector is not None or self.lilicorr is not None or self._is_domino:
            raise ValueError(f"DFLASH_ADAPTIVE supports plain DFlash drafters; this drafter has a "
                             f"selector/LiLiCorr/Domino head: {fix}")
        if self.use_compact_draft_cache:
            raise ValueError(f"DFLASH_ADAPTIVE does not support a draft window (speculative_draft_window_size); "
                             f"unset it or {fix}")
        if upstream.get_parallel().attn_dp_enabled:
            raise ValueError(f"DFLASH_ADAPTIVE does not support data-parallel attention: {fix}")

    def _checked_trees(self, settings: AdaptiveSettings, tp_size: int) -> bool:
        """Whether any candidate width verifies a tree; refused where trees are not built (the preflight's rule)."""
        widths = settings.controller.tree_widths(self.max_block)
        why = refusals.tree_refusal(torch.device(self.device).type, tp_size) if widths else None
        if why is not None:
            raise ValueError(f"DFLASH_ADAPTIVE {refusals.tree_widths_error(widths, self.max_block, why)}")
        return bool(widths)

    def _take_triton_branches_on_cpu(self) -> None:
        """CI test mode (names.TRITON_ON_CPU): take upstream's Triton prepare-block and accept/bonus branches on CPU,
        run by Triton's interpreter, so the code a GPU runs -- buffers, strides, views -- runs in CI too."""
        if upstream.is_cuda():
            return  # already on
        if os.environ.get(names.TRITON_INTERPRET) != "1":
            raise ValueError(f"{names.TRITON_ON_CPU}=1 on CPU needs {names.TRITON_INTERPRET}=1 in the server's "
                             f"environment (Triton's interpreter runs the kernels on CPU tensors)")
        self._use_triton_prepare_block = self._use_triton_accept_bonus = True
        logger.info("dflash-serve DFLASH_ADAPTIVE: upstream Triton prepare-block and accept/bonus kernels on CPU "
                    "(Triton interpreter)")

    # -- start-up ----------------------------------------------------------------------------------------------
    def init_attention_backends(self) -> None:
        super().init_attention_backends()
        if self._need_mamba_verify_commit:
            raise ValueError("DFLASH_ADAPTIVE does not support hybrid (mamba) targets: serve this pair with "
                             "speculative.algorithm: dflash")
        if self._trees and upstream.is_cuda():  # the target's backends exist now (the scheduler built them first)
            why = tree_verify_refusal(self.model_runner)
            if why is not None:
                trees = [b for b in self.loop.candidates if b > self.max_block]
                raise ValueError(f"DFLASH_ADAPTIVE {refusals.tree_widths_error(trees, self.max_block, why)}")

    def init_cuda_graphs(self) -> None:
        super().init_cuda_graphs()  # the draft graphs (full block) and upstream's start-up state
        if upstream.is_cuda():
            # every candidate: a chain width as upstream captures it, a tree width with its custom mask
            self._verify_runtimes = capture_verify_runtimes(self.model_runner, list(self.loop.candidates),
                                                            self.max_block)
            pool = self.model_runner.token_to_kv_pool
            if self._verify_runtimes.extra_widths and not getattr(pool, "post_capture_active", False):
                logger.warning(
                    "dflash-serve DFLASH_ADAPTIVE: verify CUDA graphs for widths %s were captured after the KV pool "
                    "was sized (SGLang's post-capture KV sizing, %s, is off for this configuration): their memory "
                    "comes out of the headroom model.mem_fraction_static leaves. Lower mem_fraction_static or "
                    "speculative.adaptive.candidates if start-up or the first requests run out of memory.",
                    self._verify_runtimes.extra_widths, names.SGLANG_POST_CAPTURE_KV_SIZING)

    def prewarm_sampling(self):
        result = super().prewarm_sampling()
        if upstream.is_cuda() and upstream.is_dflash_sampling_verify_available():
            # chain-verify buffers are keyed by (device index, width): size every width before anything borrows
            # graph memory, on the indexed device the verify's logits live on ("cuda" has index None: never read)
            device = torch.device("cuda", torch.cuda.current_device())
            for b in self._chain_widths():  # a tree's accept is the walk's, not the chain kernel's
                upstream._get_or_create_chain_verify_buffers(bs=self._prewarm_batch_size(b), draft_token_num=b,
                                                             device=device)
        return result

    def _chain_widths(self) -> list[int]:
        """The candidate widths that verify a chain (the rest, above the block, verify a tree)."""
        return [b for b in self.loop.candidates if b <= self.max_block]

    # -- upstream buffers, made width-aware ----------------------------------------------------------------------
    def _ensure_accept_bonus_buffers(self, bs: int) -> None:
        """Upstream sizes out_tokens [cap, self.block_size]; self.block_size is the verify width during the accept,
        so the buffers would be as wide as the step that first allocates them, and a wider step would make the
        Triton accept kernel write past them. Allocate for the trained block B, whatever the width now."""
        width, self.block_size = self.block_size, self.max_block
        try:
            super()._ensure_accept_bonus_buffers(bs)
        finally:
            self.block_size = width

    def _next_accept_bonus_buffers(self, bs: int):
        """Upstream hands out [:bs] rows of the [cap, B] buffers; a width-b accept needs a contiguous [bs, b] view
        of the same storage (b = self.block_size while _verify accepts, see there)."""
        accept_len, commit_lens, bonus, out_tokens, new_seq_lens = super()._next_accept_bonus_buffers(bs)
        w = int(self.block_size)
        if w != self.max_block:
            out_tokens = out_tokens.view(-1)[: bs * w].view(bs, w)
        return accept_len, commit_lens, bonus, out_tokens, new_seq_lens

    # -- the decode step ---------------------------------------------------------------------------------------
    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None):
        now = time.perf_counter()
        mode = batch.forward_mode
        if mode.is_extend() or batch.is_extend_in_batch or mode.is_idle() or batch.spec_info is None:
            self._flush_deferred_append()  # a prefill reads the draft KV of cached prefixes (and may reuse slots)
            self.loop.interrupt()  # the next decode step does not follow a decode step: no step time
            return super().forward_batch_generation(batch, on_publish=on_publish, grammar_barrier=grammar_barrier,
                                                    pp_proxy_tensors=pp_proxy_tensors)
        self._validate_phase1_sampling_support(batch)
        rids = [req.rid for req in batch.reqs]
        decision = self.loop.begin_decode(rids, now, trees=self._trees and self._tree_serves(batch),
                                          sampled=_sampled(batch), ragged=self._ragged and self._ragged_serves(batch))
        self._verify_runtimes.activate(decision.block_size)
        return self._decode(batch, rids, decision, on_publish, grammar_barrier)

    def _decode(self, batch, rids: list[str], decision: Decision, on_publish, grammar_barrier):
        """Draft (full block, the first b positions, or skipped), verify the first b, accept, append; hand the host
        copies to the loop."""
        draft_input = batch.spec_info
        if not isinstance(draft_input, upstream.DFlashDraftInputV2):
            raise RuntimeError("DFLASH_ADAPTIVE expected DFlashDraftInputV2 state on the running batch.")
        batch.seq_lens.record_stream(torch.get_device_module(self.device).current_stream())
        bs, B, b = len(batch.seq_lens), self.max_block, decision.block_size
        if decision.widths is not None:
            return self._decode_ragged(batch, rids, decision, draft_input, bs, on_publish)
        if b == 1 and not decision.draft_full:
            return self._decode_width1(batch, rids, decision, draft_input, bs, on_publish, grammar_barrier)
        if b > B:
            return self._decode_tree(batch, rids, decision, draft_input, bs, on_publish, grammar_barrier)
        self._flush_deferred_append()  # the draft reads its KV: it must hold every committed token
        window = self._plan_window(batch, draft_input, bs)
        tokens = self._draft_block_tokens_buf[:bs]  # [bs, B]: anchor, then the drafted block
        tokens[:, 0].copy_(draft_input.bonus_tokens)
        drafted = None
        if decision.draft_full:
            tokens[:, 1:].copy_(self._draft(batch, window, bs, B))
            drafted = tokens[:, 1:].to("cpu", non_blocking=True)
        elif b > 1:  # the controller asks for less than the full block only with prefix drafts
            tokens[:, 1:b].copy_(self._draft(batch, window, bs, b))
        cand = tokens if b == B else tokens[:, :b].contiguous()
        result = self._verify(batch, draft_input, window, cand, b, bs, on_publish, grammar_barrier)
        committed = result.next_token_ids.view(bs, b).to("cpu", non_blocking=True)
        self.loop.launched(LaunchedStep(rids, decision, drafted, committed))
        return result

    def _ragged_serves(self, batch) -> bool:
        """Whether this batch's step may verify a width per request: on CPU (the torch attention reads the ragged
        layout; GPU verify graphs are per width), and a greedy batch with nothing applied to the verify logits
        (upstream's own test for skipping them, and ours for penalties) -- its accept is then an argmax per row."""
        return (self._prefix_drafts and not upstream.is_cuda() and self._tree_serves(batch)
                and self._can_skip_verify_logits(batch, batch.sampling_info))

    def _decode_ragged(self, batch, rids: list[str], decision: Decision, draft_input, bs: int, on_publish):
        """A ragged step: request i drafts and verifies the first ``decision.widths[i]`` positions of its window --
        what a width-widths[i] step would run for it -- in one draft and one verify forward of sum(widths) rows
        (RaggedBlock). The accept runs on the padded [bs, W] layout (W the widest): a padded candidate is -1,
        which no argmax equals, so request i accepts at most widths[i] - 1 drafts and its bonus is the target's
        token at a row it verified."""
        self._flush_deferred_append()  # the draft reads its KV: it must hold every committed token
        W = int(decision.block_size)
        lens = torch.tensor(decision.widths, dtype=torch.int64, device=self.device)
        ragged = RaggedBlock.of(lens, W)
        window = self._plan_window(batch, draft_input, bs)
        # the ragged rows as a flat index into the [bs, B] window (KVLocPlan cols)
        cols = (ragged.rows // W) * self.max_block + ragged.rows % W
        drafted = self._draft(batch, window, bs, W, ragged=ragged, cols=cols)  # [bs, W - 1], -1 past each width
        cand = torch.cat([draft_input.bonus_tokens.view(bs, 1).to(torch.int64), drafted], dim=1)
        positions = window.positions[:, :W].reshape(-1).index_select(0, ragged.rows)
        target_out, target_predict = self._verify_forward(batch, draft_input, window, cand, positions, bs, None,
                                                          ragged=ragged, cols=cols)
        logits_output = target_out.logits_output
        if target_predict is None:
            target_predict = torch.argmax(logits_output.next_token_logits, dim=-1)
        predict = ragged.pad(target_predict.view(-1).to(torch.int64)).view(bs, W)
        self.block_size = W  # upstream's accept reads the verify width from it (see _verify)
        try:
            accept_len, commit_lens, bonus, out_tokens, new_seq_lens = self._accept_block(
                candidates=cand, next_token_logits=None, sampling_info=batch.sampling_info, draft_input=draft_input,
                prefix_lens=window.prefix_lens, bs=bs, target_predict=predict)
        finally:
            self.block_size = self.max_block
        out_tokens.clamp_(min=0)  # past each commit length: a padded candidate's -1, read by nothing
        new_seq_lens = _published(window.prefix_lens, commit_lens, new_seq_lens, on_publish)
        hidden = _target_hidden(logits_output)
        cache_loc = window.plan.write_ids(self.draft_model_runner.kv_index_translator, cols=slice(0, W))
        self._append_committed(ragged.pad(hidden).view(bs, W, -1), cache_loc.view(bs, W),
                               window.positions[:, :W], commit_lens)
        logits_output.hidden_states = None
        logits_output.next_token_logits = None  # the packed rows' logits: nothing downstream reads them (greedy)
        committed = out_tokens.view(bs, W).to("cpu", non_blocking=True)
        self.loop.launched(LaunchedStep(rids, decision, None, committed))
        return self._result(target_out, out_tokens, commit_lens, bonus, new_seq_lens, W)

    def _tree_serves(self, batch) -> bool:
        """Whether this batch's step may verify a tree: nothing in it depends on the candidates being one chain --
        grammars (a chain's token tree), logprobs (reported per chain row), per-row penalties (replayed along the
        chain), custom logit processors and sampling masks. Such a batch verifies the chain this step."""
        si = batch.sampling_info
        if batch.has_grammar or batch.return_logprob:
            return False
        if si is None:
            return True
        return not (si.has_custom_logit_processor or si.sampling_mask_batch_indices is not None
                    or verify_rows.active_penalizers(getattr(si, ORCHESTRATOR, None)))

    def _decode_tree(self, batch, rids: list[str], decision: Decision, draft_input, bs: int, on_publish,
                     grammar_barrier):
        """A DDTree step (module docstring, step 5): draft the full block once and keep its top-k marginals, build
        the n - 1 most likely prefixes (n = the decision's width > B), verify root + tree in n slots under the
        ancestor mask, walk the target's choices, then reorder the window's slots in req_to_token
        so the committed path's KV sits at the committed positions, and append the path's target features to the
        draft KV."""
        self._flush_deferred_append()
        n, B = decision.block_size, self.max_block
        window = self._wide_window(batch, draft_input, bs, n)
        logp, top = self._draft(batch, window, bs, self.max_block, marginals_k=min(n - 1, TREE_TOP_K))
        trees = build_trees(logp, top, n - 1)
        drafted = top[:, :, 0].to("cpu", non_blocking=True)  # the greedy block: hindsight's evidence, as a chain
        cand = torch.cat([draft_input.bonus_tokens.view(bs, 1).to(torch.int64), trees.token], dim=1)  # [bs, n]
        positions = tree_positions(window.prefix_lens, trees.depth).reshape(-1)
        mask = ancestor_mask(trees.parent)
        # the layout GPU attention reads, on every device (the CPU attention unpacks it); sized from the host's
        # bound of the KV lengths the verify runs with (no device sync), less the window
        prefix_sum = self._host_kv_bound(batch, draft_input, bs, n)[1] - bs * n
        target_out, target_predict = self._verify_forward(batch, draft_input, window, cand, positions, bs,
                                                          grammar_barrier,
                                                          tree_mask=packed(mask, window.prefix_lens, prefix_sum))
        logits_output = target_out.logits_output
        choice = self._tree_choice(logits_output.next_token_logits, target_predict, batch.sampling_info, cand,
                                   draft_input, bs)
        accepted, path, bonus = walk(trees, choice, depth=self.max_block - 1, mask=mask)
        order = window_order(path, n)
        commit_lens = (accepted + 1).to(torch.int32)
        ordered = cand.gather(1, order)  # root, the path's tokens, then the rest
        out_tokens = torch.cat([ordered[:, 1:], ordered[:, :1]], dim=1)
        out_tokens.scatter_(1, accepted.unsqueeze(1), bonus.unsqueeze(1))  # the path's tokens, then the bonus
        stride = B  # the scheduler's row stride: a path is at most B - 1 deep, so B columns hold a commit
        out_tokens = out_tokens[:, :stride].contiguous()
        # the committed positions prefix .. prefix + accepted take their nodes' slots (no K/V copy)
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        rows = batch.req_pool_indices.to(torch.int64).unsqueeze(1)
        cols = window.prefix_lens.to(torch.int64).unsqueeze(1) + torch.arange(n, device=order.device)
        req_to_token[rows, cols] = window.cache_loc[:, :n].gather(1, order).to(req_to_token.dtype)
        new_seq_lens = _published(window.prefix_lens, commit_lens, None, on_publish)
        hidden = _target_hidden(logits_output).view(bs, n, -1)
        hidden = hidden.gather(1, order.unsqueeze(2).expand(bs, n, hidden.shape[-1]))
        draft_loc = window.plan.write_ids(self.draft_model_runner.kv_index_translator, cols=slice(0, n))
        draft_loc = draft_loc.view(bs, n).gather(1, order)
        self._append_committed(hidden, draft_loc, window.positions[:, :n], commit_lens)
        logits_output.hidden_states = None
        result = self._result(target_out, out_tokens, commit_lens, bonus, new_seq_lens, stride)
        self.loop.launched(LaunchedStep(rids, decision, drafted, out_tokens.to("cpu", non_blocking=True),
                                        tree_path=path.to("cpu", non_blocking=True)))
        return result

    def _tree_choice(self, logits: torch.Tensor | None, target_predict: torch.Tensor | None, sampling_info,
                     cand: torch.Tensor, draft_input, bs: int) -> torch.Tensor:
        """The target's token after every node ([bs, n]): its argmax, or one sample of the distribution plain
        decoding samples there (logit_bias, temperature, top-k/top-p/min_p: the chain accept's own functions)."""
        n = int(cand.shape[1])
        if target_predict is not None:
            choice, site = target_predict, upstream.SpecTpSyncSite.DFLASH_ACCEPT_GREEDY
        else:
            if sampling_info is not None:  # logit_bias (no penalizer is active: _tree_serves)
                verify_rows.apply_accept_adjustments(logits.view(bs, n, -1), cand, sampling_info, None)
            if upstream._is_all_greedy(sampling_info):
                choice, site = torch.argmax(logits, dim=-1), upstream.SpecTpSyncSite.DFLASH_ACCEPT_GREEDY
            else:
                probs = dflash_utils.build_speculative_verify_target_probs(  # patched: the sampler's cuts
                    next_token_logits=logits, sampling_info=sampling_info, draft_token_num=n, bs=bs,
                    max_top_k=draft_input.max_top_k, uniform_top_k_value=draft_input.uniform_top_k_value)
                choice, site = sampling_from_probs_torch(probs), upstream.SpecTpSyncSite.DFLASH_ACCEPT_SAMPLE
        choice = choice.view(bs, n).to(torch.int64)
        self._tp_sync.sync(site, choice)
        return choice

    def _decode_width1(self, batch, rids: list[str], decision: Decision, draft_input, bs: int, on_publish,
                       grammar_barrier):
        """Speculation off: verify the anchor alone in the first slot of the window -- a decode step -- and defer
        the draft-KV append (see the module docstring)."""
        if rids != self._deferred_rids:
            # a request left: its KV slots may already be another's, and one pass must not write a slot twice
            self._flush_deferred_append()
            self._deferred_rids = rids
        window = self._width1_window(batch, draft_input, bs)
        cand = draft_input.bonus_tokens.view(bs, 1)
        result = self._verify(batch, draft_input, window, cand, 1, bs, on_publish, grammar_barrier,
                              defer_append=self._defer_width1_append)
        committed = result.next_token_ids.view(bs, 1).to("cpu", non_blocking=True)
        self.loop.launched(LaunchedStep(rids, decision, None, committed))
        if len(self._deferred) >= DEFERRED_APPEND_STEPS:
            self._flush_deferred_append()
        return result

    def _width1_window(self, batch, draft_input, bs: int) -> StepWindow:
        """The first slot of the step's window only: the slot the scheduler reserved at the committed length."""
        prefix_lens = batch.seq_lens
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        loc = req_to_token[batch.req_pool_indices, prefix_lens].to(torch.int64).view(bs, 1)
        plan = self.target_worker.model_runner.kv_index_translator.plan(
            req_pool_indices=batch.req_pool_indices, seq_lens=prefix_lens,
            seq_lens_cpu=batch.seq_lens_cpu if batch.seq_lens_cpu is not None else draft_input.nxt_kv_lens_cpu,
            write_virtual=loc.view(-1), read_extent=1)
        return StepWindow(None, prefix_lens.to(torch.int64).view(bs, 1), loc, plan, prefix_lens)

    def _append_committed(self, hidden: torch.Tensor, cache_loc: torch.Tensor, positions: torch.Tensor,
                          commit_lens: torch.Tensor) -> None:
        """Append the committed tokens' target features to the draft KV: row i's first commit_lens[i] of its
        ``[bs, w]`` columns (``hidden`` [bs, w, D]; ``cache_loc`` draft-pool slots, ``positions``).

        GPU: upstream's prefix-valid writer (it projects every column and writes the live prefix: no host sync).
        CPU: only the committed rows are projected (upstream's flat writer): the lengths are host memory already,
        and a width-16 step at acceptance ~3.5 would project 16 rows a request to keep ~4.5 of them. A row's K/V
        depends on that row alone (up to the rounding of a matmul over fewer rows: the draft's proposals, never the
        committed tokens)."""
        bs, w = int(cache_loc.shape[0]), int(cache_loc.shape[1])
        if not self._compact_appends:
            self._append_target_hidden_to_draft_kv_by_loc(
                target_hidden=hidden.reshape(bs * w, -1), cache_loc=cache_loc.reshape(-1), cache_loc_2d=cache_loc,
                positions=positions.reshape(-1), commit_lens=commit_lens)
            return
        if w > 1:
            keep = (torch.arange(w, device=commit_lens.device) < commit_lens.view(bs, 1)).view(-1).nonzero().view(-1)
            hidden = hidden.reshape(bs * w, -1).index_select(0, keep)
            cache_loc = cache_loc.reshape(-1).index_select(0, keep)
            positions = positions.reshape(-1).index_select(0, keep)
        self._append_target_hidden_to_draft_kv_by_loc(target_hidden=hidden.reshape(-1, hidden.shape[-1]),
                                                      cache_loc=cache_loc.reshape(-1),
                                                      positions=positions.reshape(-1))

    def _flush_deferred_append(self) -> None:
        """Write the deferred width-1 appends in one pass (the writer a per-step append uses: _append_committed)."""
        if not self._deferred:
            return
        steps, self._deferred = self._deferred, []
        hidden = torch.cat([d.hidden for d in steps])
        cache_loc = torch.cat([d.cache_loc for d in steps])
        positions = torch.cat([d.positions for d in steps])
        n = int(cache_loc.numel())
        self._append_committed(hidden.view(n, 1, -1), cache_loc.view(n, 1), positions.view(n, 1),
                               torch.ones(n, dtype=torch.int32, device=cache_loc.device))

    def _plan_window(self, batch, draft_input, bs: int) -> StepWindow:
        """The step's KV window of B slots per request (upstream's block preparation, unchanged)."""
        B = self.max_block
        self._ensure_draft_block_buffers(bs)
        block_ids = self._draft_block_ids_buf[:bs]
        prefix_lens = batch.seq_lens
        positions_2d = self._draft_block_positions_buf[:bs]
        loc_2d = self._draft_verify_out_cache_loc_buf[:bs]
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        prepared = False
        if self._use_triton_prepare_block:
            try:
                upstream._prepare_dflash_draft_block_unchecked(
                    bonus_tokens=draft_input.bonus_tokens.view(-1), prefix_lens=prefix_lens.view(-1),
                    req_pool_indices=batch.req_pool_indices.view(-1), req_to_token=req_to_token,
                    block_ids_out=block_ids, positions_out=positions_2d, cache_loc_out=loc_2d,
                    mask_token_id=int(self._mask_token_id))
                prepared = True
            except Exception as e:  # same policy as upstream: fall back to eager for good
                self._use_triton_prepare_block = False
                logger.warning("DFLASH Triton prepare_block failed; falling back to eager path: %s", e)
        if not prepared:
            block_ids.fill_(int(self._mask_token_id))
            block_ids[:, 0].copy_(draft_input.bonus_tokens)
            torch.add(prefix_lens.unsqueeze(1), self._block_pos_offsets, out=positions_2d)
            loc = upstream.assign_extend_cache_locs_func(
                req_pool_indices=batch.req_pool_indices, req_to_token=req_to_token, start_offset=prefix_lens,
                end_offset=prefix_lens + B, batch_size=bs, draft_token_num=B, device=self.device)
            loc_2d.copy_(loc.view(bs, B))
        plan = self.target_worker.model_runner.kv_index_translator.plan(
            req_pool_indices=batch.req_pool_indices, seq_lens=prefix_lens,
            seq_lens_cpu=batch.seq_lens_cpu if batch.seq_lens_cpu is not None else draft_input.nxt_kv_lens_cpu,
            write_virtual=loc_2d.reshape(-1), read_extent=B)
        return StepWindow(block_ids, positions_2d, loc_2d, plan, prefix_lens)

    def _wide_window(self, batch, draft_input, bs: int, n: int) -> StepWindow:
        """A tree's window of n > B slots: positions prefix .. prefix + n - 1 (the decode reserve is widened for it,
        patches/dflash_headroom.py); the draft forward takes its first B columns, as from _plan_window's."""
        self._ensure_draft_block_buffers(bs)
        block_ids = self._draft_block_ids_buf[:bs]
        block_ids.fill_(int(self._mask_token_id))
        block_ids[:, 0].copy_(draft_input.bonus_tokens)
        prefix_lens = batch.seq_lens
        positions = prefix_lens.to(torch.int64).unsqueeze(1) + torch.arange(n, device=prefix_lens.device)
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        loc = req_to_token[batch.req_pool_indices.to(torch.int64).unsqueeze(1), positions].to(torch.int64)
        plan = self.target_worker.model_runner.kv_index_translator.plan(
            req_pool_indices=batch.req_pool_indices, seq_lens=prefix_lens,
            seq_lens_cpu=batch.seq_lens_cpu if batch.seq_lens_cpu is not None else draft_input.nxt_kv_lens_cpu,
            write_virtual=loc.reshape(-1), read_extent=n)
        return StepWindow(block_ids, positions, loc, plan, prefix_lens)

    def _host_kv_bound(self, batch, draft_input, bs: int, width: int):
        """(seq_lens_cpu, sum): a host upper bound of each request's KV length during a width-`width` forward."""
        if batch.seq_lens_cpu is not None:
            lens = batch.seq_lens_cpu + width
            return lens, int(lens.sum())
        if draft_input.nxt_kv_lens_cpu is not None:  # GPU-only backend: the reservation is a safe over-estimate
            return draft_input.nxt_kv_lens_cpu, int(draft_input.nxt_kv_lens_sum)
        lens = torch.tensor([req.kv.kv_allocated_len for req in batch.reqs], dtype=torch.int64)
        return lens, int(lens.sum())

    def _draft(self, batch, window: StepWindow, bs: int, width: int, marginals_k: int = 0,
               ragged: RaggedBlock | None = None, cols: torch.Tensor | None = None):
        """Upstream's draft forward over the first ``width`` positions of the window (the full block B, or a prefix
        with prefix drafts) -> greedy draft tokens [bs, width - 1]; with ``marginals_k``, the top-k marginals of
        those positions instead (``_marginals``: a tree step's input, from the same one forward). ``ragged``
        (``cols``: its rows in the window): request i drafts its first ragged.lens[i] positions only; the result
        is -1 past them."""
        full = width == self.max_block
        spec_info = self._draft_spec_info_by_width.get(width) if ragged is None else None
        if ragged is not None:  # this step's own: it carries the layout to the attention (cpu_layer.RAGGED_ATTR)
            spec_info = upstream.make_draft_block_spec_info(draft_token_num=width, device=self.device)
            setattr(spec_info, RAGGED_ATTR, ragged)
        elif spec_info is None:
            spec_info = self._draft_spec_info_by_width[width] = upstream.make_draft_block_spec_info(
                draft_token_num=width, device=self.device)
        target_model = self.target_worker.model_runner.model
        embed = upstream.unwrap_lora_layer(upstream._resolve_dflash_embedding_module(self.draft_model, target_model))
        lm_head = upstream.unwrap_lora_layer(getattr(target_model, "lm_head", None))
        block_ids = window.block_ids if full else window.block_ids[:, :width].contiguous()
        rows = bs * width
        positions = window.positions[:, :width].reshape(-1)
        if ragged is not None:
            block_ids = block_ids.reshape(-1).index_select(0, ragged.rows)
            positions = positions.index_select(0, ragged.rows)
            rows = int(ragged.rows.shape[0])
        if self._full_embed_gpu is not None:
            noise = torch.nn.functional.embedding(block_ids, self._full_embed_gpu)
        else:
            noise = embed(block_ids)
        if self._noise_embed_scale != 1.0:
            noise = noise * self._noise_embed_scale
        seq_lens_cpu = self._draft_seq_lens_cpu_buf[:bs]
        lens, lens_sum = self._host_kv_bound(batch, batch.spec_info, bs, width)
        seq_lens_cpu.copy_(lens)
        forward_batch = upstream.ForwardBatch(
            forward_mode=upstream.ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=block_ids.flatten(),
            req_pool_indices=batch.req_pool_indices, seq_lens=window.prefix_lens,
            out_cache_loc=window.cache_loc[:, :width].reshape(-1) if ragged is None else None,
            seq_lens_sum=lens_sum, seq_lens_cpu=seq_lens_cpu,
            positions=positions, input_embeds=noise.view(-1, noise.shape[-1]),
            spec_algorithm=upstream.SpeculativeAlgorithm.DFLASH, spec_info=spec_info,
            capture_hidden_mode=upstream.CaptureHiddenMode.NULL,
            num_token_non_padded=(torch.full((), rows, dtype=torch.int32, device=self.device)
                                  if upstream.enable_num_token_non_padded() else None),
            global_num_token_non_padded_cpu=rows,
            can_run_decode_cuda_graph=batch.can_run_decode_cuda_graph and ragged is None)
        window.plan.bind(forward_batch, self.draft_model_runner.kv_index_translator,
                         cols=cols if ragged is not None
                         else None if window.cache_loc.shape[1] == width else slice(0, width))
        with torch.inference_mode(), upstream.draft_tp_context(self.draft_parallel_layout):
            out = self.draft_model_runner.forward(forward_batch)
        if self._draft_sampler is not None and out.can_run_graph and not marginals_k:
            return self._draft_sampler.out[: bs * (width - 1)].view(bs, width - 1)  # the greedy head, in the graph
        # (a tree step's marginals read the hidden states: the draft graph outputs them, its head is folded after)
        hidden = out.logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("DFLASH draft model returned no hidden states.")
        if ragged is not None:
            drafted = ragged.rows % width != 0  # every row but the anchors
            with upstream.draft_tp_context(self.draft_parallel_layout):
                greedy = self._greedy_sample_from_vocab_parallel_head(hidden_states=hidden[drafted], lm_head=lm_head)
            out_tokens = torch.full((bs * width,), -1, dtype=torch.int64, device=hidden.device)
            out_tokens[ragged.rows[drafted]] = greedy.view(-1).to(torch.int64)
            return out_tokens.view(bs, width)[:, 1:]
        hidden = hidden.view(bs, width, -1)
        if marginals_k:
            return self._marginals(hidden[:, 1:, :], lm_head, marginals_k)
        with upstream.draft_tp_context(self.draft_parallel_layout):
            return self._greedy_sample_from_vocab_parallel_head(
                hidden_states=hidden[:, 1:, :].reshape(-1, hidden.shape[-1]), lm_head=lm_head).view(bs, width - 1)

    @staticmethod
    def _marginals(hidden: torch.Tensor, lm_head, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's top-``k`` log-probabilities and tokens at every drafted position ([bs, D, k] each, sorted
        descending): the same LM head the greedy draft takes its argmax from (tensor parallel 1: refused otherwise
        at start-up), over the vocabulary without its padding rows."""
        weight = lm_head.weight
        shard = getattr(lm_head, "shard_indices", None)
        if shard is not None:
            weight = weight[: int(shard.num_org_elements)]
        return top_log_probs(torch.matmul(hidden.to(weight.dtype), weight.T), k)

    def _verify_forward(self, batch, draft_input, window: StepWindow, cand: torch.Tensor, positions: torch.Tensor,
                        bs: int, grammar_barrier, tree_mask: torch.Tensor | None = None,
                        ragged: RaggedBlock | None = None, cols: torch.Tensor | None = None):
        """The target's verify forward of [bs, n] candidates written to the first n slots of the window, at
        ``positions``, then the logit adjustments every accept applies (custom logit processors, grammar) ->
        (target_out, target_predict: its argmax when upstream skipped the full logits, else None). ``tree_mask``
        (the ancestor mask, tree/mask.py packed): a tree verify (the grammar is a chain's; tree steps never have
        one).
        ``ragged`` (``cols``: its rows in the window): the packed rows of ``cand`` only, at packed ``positions``
        (``_decode_ragged``: greedy, nothing applied to the logits)."""
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
            batch.seq_lens_cpu, batch.seq_lens_sum = self._host_kv_bound(batch, draft_input, bs, n)
        verify_batch, _ = verify_input.prepare_for_verify(batch, self.target_worker, defer_metadata_init=False)
        batch.seq_lens_cpu, batch.seq_lens_sum = saved
        target_out = self.target_worker.forward_batch_generation(
            batch=None, forward_batch=verify_batch, is_verify=True,
            skip_attn_backend_init=None if upstream._is_npu else True)
        logits_output = target_out.logits_output
        target_predict = None
        lp = self._target_logits_processor
        if lp is not None and lp.is_deferred_shard(logits_output.next_token_logits):
            if self._can_skip_verify_logits(batch, sampling_info):
                target_predict = lp.deferred_argmax(logits_output.next_token_logits)
                logits_output.next_token_logits = None
            else:
                logits_output.next_token_logits = lp.finish_deferred_gather(logits_output.next_token_logits)
        grammar_mask = None
        if batch.has_grammar:
            grammar_mask = upstream.build_grammar_vocab_mask(
                reqs=batch.reqs, tree=grammar_tree, sampling_info=sampling_info,
                device=logits_output.next_token_logits.device, barrier=grammar_barrier)
        if sampling_info is not None and target_predict is None:
            upstream.apply_dflash_verify_logits_adjustments(
                next_token_logits=logits_output.next_token_logits, sampling_info=sampling_info, draft_token_num=n)
        if grammar_mask is not None:
            grammar_mask.apply(logits_output.next_token_logits)
        return target_out, target_predict

    def _verify(self, batch, draft_input, window: StepWindow, cand: torch.Tensor, b: int, bs: int, on_publish,
                grammar_barrier, defer_append: bool = False):
        """Target verify of [bs, b] candidates, accept, and the draft-KV append (upstream's, at width b; kept for
        a batched pass when ``defer_append``, width 1 only: one committed token per request)."""
        cols = slice(0, b)  # this step writes the first b slots of its B-slot window
        plan, prefix_lens = window.plan, window.prefix_lens
        positions = window.positions[:, :b].reshape(-1)
        sampling_info = batch.sampling_info
        target_out, target_predict = self._verify_forward(batch, draft_input, window, cand, positions, bs,
                                                          grammar_barrier)
        logits_output = target_out.logits_output

        if b == 1:
            accept_len, commit_lens, bonus, out_tokens, new_seq_lens = self._accept_width1(
                cand, logits_output.next_token_logits, sampling_info, draft_input, bs, target_predict)
        else:
            # upstream's accept reads self.block_size as the verify width (target_predict.view(bs, block_size)):
            # it is b for the accept only; everywhere else it stays the trained block B
            self.block_size = b
            try:
                accept_len, commit_lens, bonus, out_tokens, new_seq_lens = self._accept_block(
                    candidates=cand, next_token_logits=logits_output.next_token_logits, sampling_info=sampling_info,
                    draft_input=draft_input, prefix_lens=prefix_lens, bs=bs, target_predict=target_predict)
            finally:
                self.block_size = self.max_block
        mask_capture = upstream.SpeculativeSamplingMaskCapture.from_logits(
            sampling_info, next_token_logits=logits_output.next_token_logits, draft_input=draft_input,
            draft_token_num=b, bs=bs)
        if mask_capture is not None:
            logits_output.sampling_mask_output = mask_capture.build_output(out_tokens=out_tokens,
                                                                           commit_lens=commit_lens)
        if batch.return_logprob:
            upstream.compute_spec_logprobs(batch, logits_output, out_tokens.reshape(-1), chain_stride=b)
        new_seq_lens = _published(prefix_lens, commit_lens, new_seq_lens, on_publish)
        hidden = _target_hidden(logits_output).view(bs, b, -1)
        cache_loc = plan.write_ids(self.draft_model_runner.kv_index_translator, cols=cols)
        if defer_append:  # a copy: a CUDA graph's output buffer is overwritten by the next replay
            self._deferred.append(DeferredAppend(hidden.reshape(bs, -1).clone(), cache_loc.reshape(-1).clone(),
                                                 positions.to(torch.int64, copy=True)))
        else:
            self._append_committed(hidden, cache_loc.view(bs, b), positions.view(bs, b), commit_lens)
        logits_output.hidden_states = None
        return self._result(target_out, out_tokens, commit_lens, bonus, new_seq_lens, b)

    def _result(self, target_out, out_tokens: torch.Tensor, commit_lens: torch.Tensor, bonus: torch.Tensor,
                new_seq_lens: torch.Tensor, stride: int):
        """The step's result for the scheduler: ``out_tokens`` [bs, stride] (its row stride of next_token_ids),
        each row's first commit_lens[i] committed."""
        return upstream.GenerationBatchResult(
            logits_output=target_out.logits_output, next_token_ids=out_tokens.reshape(-1), accept_lens=commit_lens,
            can_run_cuda_graph=target_out.can_run_cuda_graph,
            next_draft_input=self._make_next_draft_input_decode(bonus_tokens=bonus, new_seq_lens=new_seq_lens),
            speculative_num_draft_tokens=stride, new_seq_lens=new_seq_lens,
            routed_experts_output=target_out.routed_experts_output,
            indexer_topk_output=target_out.indexer_topk_output)

    def _accept_width1(self, cand: torch.Tensor, logits: torch.Tensor | None, sampling_info, draft_input, bs: int,
                       target_predict: torch.Tensor | None):
        """The accept of a width-1 step: no draft to verify, so the step commits plain decoding's token for the
        anchor's row -- its argmax, or a sample of the distribution plain decoding samples (SGLang's own sampling
        function; a softmax alone when no top-k/top-p/min_p applies, as in SGLang's sampler). Upstream's chain accept
        would reach the same distribution through a sort of the vocabulary and the chain kernel: 1.5 ms of an
        11 ms step on CPU at temperature 1 (benchmarks/results/step_profile_cpu.md). Returns upstream's
        (accept_len, commit_lens, bonus, out_tokens, None)."""
        if logits is not None and sampling_info is not None:  # penalties and logit_bias, as every accept
            verify_rows.apply_accept_adjustments(logits.view(bs, 1, -1), cand, sampling_info,
                                                 getattr(sampling_info, ORCHESTRATOR, None))
        if target_predict is not None or upstream._is_all_greedy(sampling_info):
            bonus = target_predict if target_predict is not None else torch.argmax(logits, dim=-1)
            site = upstream.SpecTpSyncSite.DFLASH_ACCEPT_GREEDY
        else:
            if (sampling_info.need_top_p_sampling or sampling_info.need_top_k_sampling
                    or sampling_info.need_min_p_sampling):
                probs = dflash_utils.build_speculative_verify_target_probs(  # patched: the sampler's cuts
                    next_token_logits=logits, sampling_info=sampling_info, draft_token_num=1, bs=bs,
                    max_top_k=draft_input.max_top_k, uniform_top_k_value=draft_input.uniform_top_k_value)
            else:
                probs = torch.softmax(logits.float() / sampling_info.temperatures, dim=-1)
            bonus = sampling_from_probs_torch(probs.view(bs, -1))
            site = upstream.SpecTpSyncSite.DFLASH_ACCEPT_SAMPLE
        bonus = bonus.view(bs).to(torch.int64)
        self._tp_sync.sync(site, bonus)
        accept_len = torch.zeros(bs, dtype=torch.int32, device=bonus.device)
        return accept_len, accept_len + 1, bonus, bonus.view(bs, 1), None

    # -- feedback (host side, after SGLang's copy-done sync): the loop's ------------------------------------------
    def on_verify_complete_cpu(self, num_correct_drafts_per_req: list[int], batch_size: int = 0) -> None:
        self.loop.complete(num_correct_drafts_per_req, batch_size)

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        self.loop.request_finished(rid)
