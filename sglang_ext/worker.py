"""AdaptiveDFlashWorker: upstream's DFlash worker with a verify width chosen every decode step.

Each decode step the controller picks the verify width b from the batch (``ControllerLoop.begin_decode``,
identically on every TP rank) and the step runs as one of four kinds (sglang_ext/steps/, docs/ARCHITECTURE.md §3):
a chain at b <= B (``steps/chain.py``: the drafter over its full trained block B, or over the first b positions
with prefix drafts), speculation off at b = 1 (``steps/plain.py``: a plain decode step, decided at the batch's
decode preparation under the non-overlap scheduler; else ``steps/width1.py``: the anchor verified alone; the
draft-KV append deferred in both), a DDTree at b > B (``steps/tree.py``) and per-request widths
(``steps/ragged.py``). Prefix drafts run where the draft
runs eagerly (CPU): there the draft forward is compute, so a full-block draft would cost a narrow width nearly what
the full width costs (docs/ADAPTIVE.md); GPU keeps the full block, whose draft CUDA graph is captured for B.

KV reservations stay sized for B: the scheduler reserves 2 * B slots per request per step before the worker runs
(dflash_info_v2.prepare_for_decode), and every buffer sized by upstream for B is sliced, never re-sized. A tree of
1 + N > B nodes has its own window and a reserve widened for it (patches/dflash_headroom.py).

This class holds what SGLang calls (upstream's DFlashWorkerV2 overrides) and the start-up checks; the steps are
the tensor path. The bookkeeping around them -- the decision, pending steps, step times, feedback to the controller
and Prometheus -- is controller_loop.py's (no torch, no SGLang). Feedback needs no device sync: the step's drafted
block and committed tokens are copied to the host asynchronously; SGLang calls ``on_verify_complete_cpu`` after its
own copy-done sync, in launch order, and the loop reads them then.

Supported drafters: DFlash (z-lab format) and DFlash2 (a candidate selector's path, its prefix verified at width b:
steps/draft.py; no trees or per-request widths); targets: the support matrix's families (sglang_ext/support.py,
docs/MODELS.md). Heads that propose otherwise (LiLiCorr, Domino), a draft sliding window and targets outside the
matrix are refused at start-up with the fix (serve with ``dflash``; every rule: sglang_ext/refusals.py). Hybrid
(gated-delta-net / mamba) targets are served at chain widths on CPU: the verify keeps every position's recurrent
state aside and upstream's commit keeps the accepted prefix's (``steps/verify.py``); their trees, per-request
widths and GPUs are refused.
"""
from __future__ import annotations

import logging
import os
import time

import torch

import sglang.srt.speculative.dflash_worker_v2 as upstream
from sglang.srt.runtime_context import get_memory, get_schedule
from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2

from sglang_ext import names, refusals
from sglang_ext.controller.policy import Decision, calibrated_widths
from sglang_ext.controller_loop import ControllerLoop
from sglang_ext.patches.plain_decode import PLAIN_ATTR
from sglang_ext.settings import AdaptiveSettings, adaptive_settings
from sglang_ext.steps.chain import decode_chain
from sglang_ext.steps.context import StepContext, block_size_as
from sglang_ext.steps.draft_kv import DraftKV
from sglang_ext.steps.plain import after_plain_result, before_plain_result, decode_plain, plain_ready, prepare_plain
from sglang_ext.steps.ragged import decode_ragged, ragged_serves
from sglang_ext.steps.tree import decode_tree, tree_serves
from sglang_ext.steps.width1 import decode_width1
from sglang_ext.verify_runtimes import VerifyRuntimes, capture_verify_runtimes, tree_verify_refusal

logger = logging.getLogger(__name__)


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
        # see the module docstring: prefix drafts
        self._prefix_drafts = torch.device(self.device).type == "cpu" and os.environ.get(names.FULL_DRAFTS) != "1"
        metrics = None
        if getattr(server_args, "enable_metrics", False) and rank == 0:
            from sglang_ext.metrics import DFlashMetrics

            cands = settings.controller.candidates_for(self.max_block)
            metrics = DFlashMetrics(server_args.served_model_name or server_args.model_path, self.max_block, cands,
                                    calibrated=calibrated_widths(cands, self.max_block, self._prefix_drafts))
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
        self._ragged = settings.controller.per_request_widths  # checked per step only when on (ragged_serves)
        why = refusals.per_request_widths_refusal(torch.device(self.device).type) if self._ragged else None
        if why is not None:
            raise ValueError(f"DFLASH_ADAPTIVE speculative.adaptive.per_request_widths: {why}")
        # a left request's deferred rows are written only where its slots may live on in the prefix cache
        self.draft_kv = DraftKV(super()._append_target_hidden_to_draft_kv_by_loc,
                                compact=torch.device(self.device).type == "cpu",
                                defers=os.environ.get(names.EAGER_APPEND) != "1", slots=self._draft_slots,
                                keep_left=not get_memory().disable_radix_cache)
        self._prefill = None  # the prefill batch upstream is running (its prompt context is kept, not written)
        self._ahead: tuple[list[str], Decision] | None = None  # decided at decode preparation (prepare_decode)
        if os.environ.get(names.TRITON_ON_CPU) == "1":
            self._take_triton_branches_on_cpu()
        if self.selector is not None:
            self._refuse_for_selector_drafter()
        if rank == 0:
            logger.info("dflash-serve DFLASH_ADAPTIVE: block %d, candidates %s, mode %s, cost profile %s",
                        self.max_block, self.loop.candidates, settings.controller.mode,
                        settings.cost_profile or "packaged roofline")

    def _draft_slots(self) -> int:
        """How many slot ids the draft pool has, its padding slot 0 included (a pool's buffers are size + page)."""
        pool = self.draft_model_runner.token_to_kv_pool
        return int(pool.size) + int(getattr(pool, "page_size", 1) or 1)

    @property
    def controller(self):
        return self.loop.controller

    def _refuse_unsupported(self) -> None:
        """The preflight's rules (sglang_ext/refusals.py) on what SGLang built, for a server started without it."""
        algorithm = names.ALGORITHM.lower()
        why = (refusals.drafter_head_refusal(self.lilicorr is not None, self._is_domino)
               or refusals.draft_window_refusal(self.draft_window_size, algorithm)
               or refusals.dp_attention_refusal(bool(upstream.get_parallel().attn_dp_enabled)))
        if why is not None:
            raise ValueError(f"DFLASH_ADAPTIVE {why}")
        archs = getattr(self.target_worker.model_runner.model_config.hf_config, "architectures", None) or [None]
        why = refusals.target_refusal(archs[0], algorithm)
        if why is not None:
            raise ValueError(f"DFLASH_ADAPTIVE: {why}")

    def _checked_trees(self, settings: AdaptiveSettings, tp_size: int) -> bool:
        """Whether any candidate width verifies a tree; refused where trees are not built (the preflight's rule)."""
        widths = settings.controller.tree_widths(self.max_block)
        why = (refusals.tree_refusal(torch.device(self.device).type, tp_size, get_schedule().page_size or 1)
               if widths else None)
        if why is not None:
            raise ValueError(f"DFLASH_ADAPTIVE {refusals.tree_widths_error(widths, self.max_block, why)}")
        return bool(widths)

    def _refuse_for_hybrid_target(self) -> None:
        """A hybrid target's verify commits one recurrent state per chain position (steps/verify.py): trees and
        per-request widths are refused (the preflight's rules, for a server started without dflash-serve)."""
        why = refusals.hybrid_device_refusal(torch.device(self.device).type)
        if why is not None:
            raise ValueError(f"DFLASH_ADAPTIVE {why}")
        self._refuse_trees_and_ragged(refusals.hybrid_tree_refusal(), refusals.hybrid_per_request_widths_refusal())

    def _refuse_for_selector_drafter(self) -> None:
        """A DFlash2 drafter proposes one selector path per block (steps/draft.py): trees and per-request widths are
        refused (the preflight's rules, for a server started without dflash-serve)."""
        self._refuse_trees_and_ragged(refusals.selector_tree_refusal(),
                                      refusals.selector_per_request_widths_refusal())

    def _refuse_trees_and_ragged(self, tree_why: str, ragged_why: str) -> None:
        """Refuse tree candidates and per-request widths, each with its reason."""
        trees = [b for b in self.loop.candidates if b > self.max_block]
        if trees:
            raise ValueError(f"DFLASH_ADAPTIVE {refusals.tree_widths_error(trees, self.max_block, tree_why)}")
        if self._ragged:
            raise ValueError(f"DFLASH_ADAPTIVE speculative.adaptive.per_request_widths: {ragged_why}")

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
        if self._need_mamba_verify_commit:  # known only now: upstream sets it with the target's backends
            self._refuse_for_hybrid_target()
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
                    "comes out of the headroom sglang_args.mem_fraction_static leaves. Lower it or "
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
        with block_size_as(self, self.max_block):
            super()._ensure_accept_bonus_buffers(bs)

    def _selector_sampling_accept(self, *, candidates: torch.Tensor, **kwargs):
        """Upstream keeps one dense q buffer [cap, gamma, vocab] for a DFlash2 path's sampled accept and allocates a
        new one whenever gamma differs -- every width change here. Hand it a [cap, gamma, vocab] view of one buffer
        sized for the trained block instead (upstream checks only the shape, and zeroes what it scattered)."""
        bs, gamma = int(candidates.shape[0]), int(candidates.shape[1]) - 1
        vocab = int(kwargs["next_token_logits"].shape[-1])
        full = getattr(self, "_draft_probs_full", None)
        if full is None or full.shape[0] < bs or full.shape[2] != vocab:
            cap = bs if full is None else max(bs, full.shape[0] * 2)
            full = self._draft_probs_full = torch.zeros((cap, self.max_block - 1, vocab), dtype=torch.float32,
                                                        device=candidates.device)
        self._draft_probs_buf = full[:, :gamma]
        return super()._selector_sampling_accept(candidates=candidates, **kwargs)

    def _next_accept_bonus_buffers(self, bs: int):
        """Upstream hands out [:bs] rows of the [cap, B] buffers; a width-b accept needs a contiguous [bs, b] view
        of the same storage (b = self.block_size while a step accepts: steps/accept.py)."""
        accept_len, commit_lens, bonus, out_tokens, new_seq_lens = super()._next_accept_bonus_buffers(bs)
        w = int(self.block_size)
        if w != self.max_block:
            out_tokens = out_tokens.view(-1)[: bs * w].view(bs, w)
        return accept_len, commit_lens, bonus, out_tokens, new_seq_lens

    # -- the decode step ---------------------------------------------------------------------------------------
    def prepare_decode(self, batch) -> bool:
        """The step's decision, taken at the batch's decode preparation (patches/plain_decode.py: SGLang's
        non-overlap scheduler, before it reserves the step's KV) and kept for its forward. True: the step runs as
        plain decoding (steps/plain.py: width 1 without a draft, on a batch plain decoding serves alike), and the
        batch is prepared for it -- SGLang's own preparation must not run."""
        d = self._decide(batch, [req.rid for req in batch.reqs], time.perf_counter(), keep=True)
        if d.block_size == 1 and not d.draft_full and d.widths is None and plain_ready(self, batch):
            prepare_plain(batch)
            return True
        return False

    def before_plain_result(self, scheduler, batch) -> None:
        """Before SGLang processes a plain step's result: its counters, and the controller's feedback."""
        before_plain_result(scheduler, batch)
        self.on_verify_complete_cpu([0] * batch.batch_size(), batch_size=batch.batch_size())

    def after_plain_result(self, batch, result) -> None:
        """After SGLang processed a plain step's result: the batch speculative again."""
        after_plain_result(batch, result)

    def _decide(self, batch, rids: list[str], now: float, *, keep: bool = False) -> Decision:
        """The decision taken ahead for these requests, or the controller's now (kept for the forward: ``keep``)."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == rids:
            return ahead[1]
        decision = self.loop.begin_decode(rids, now, trees=self._trees and tree_serves(batch),
                                          sampled=_sampled(batch),
                                          ragged=self._ragged and ragged_serves(self, batch))
        if keep:
            self._ahead = (rids, decision)
        return decision

    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None):
        now = time.perf_counter()
        mode = batch.forward_mode
        plain = getattr(batch, PLAIN_ATTR, None) is not None and mode.is_decode()  # prepared as plain decoding
        prefill = not plain and (mode.is_extend() or batch.is_extend_in_batch or mode.is_idle()
                                 or batch.spec_info is None)
        self.draft_kv.before_forward(decode=not prefill)  # a request that left may hand its slots to this forward
        if plain:
            rids = [req.rid for req in batch.reqs]
            decision = self._decide(batch, rids, now)
            ctx = StepContext(self, batch, rids, decision, None, len(batch.reqs), on_publish, grammar_barrier)
            return decode_plain(ctx)
        if prefill:
            self.loop.interrupt()  # the next decode step does not follow a decode step: no step time
            self._prefill = batch
            try:
                return super().forward_batch_generation(batch, on_publish=on_publish, grammar_barrier=grammar_barrier,
                                                        pp_proxy_tensors=pp_proxy_tensors)
            finally:
                self._prefill = None
        self._validate_phase1_sampling_support(batch)
        rids = [req.rid for req in batch.reqs]
        decision = self._decide(batch, rids, now)
        self._verify_runtimes.activate(decision.block_size)
        return self._decode(batch, rids, decision, on_publish, grammar_barrier)

    def _decode(self, batch, rids: list[str], decision: Decision, on_publish, grammar_barrier):
        """The decision's step kind: per-request widths, speculation off, a tree, or a chain."""
        draft_input = batch.spec_info
        if not isinstance(draft_input, upstream.DFlashDraftInputV2):
            raise RuntimeError("DFLASH_ADAPTIVE expected DFlashDraftInputV2 state on the running batch.")
        batch.seq_lens.record_stream(torch.get_device_module(self.device).current_stream())
        self._selector_sample = None  # a DFlash2 path's q is this step's draft's (steps/chain.py), never a past one's
        ctx = StepContext(self, batch, rids, decision, draft_input, len(batch.seq_lens), on_publish, grammar_barrier)
        if decision.widths is not None:
            return decode_ragged(ctx)
        if decision.block_size == 1 and not decision.draft_full:
            return decode_width1(ctx)
        if decision.block_size > self.max_block:
            return decode_tree(ctx)
        return decode_chain(ctx)

    def _append_target_hidden_to_draft_kv_by_loc(self, *, target_hidden, cache_loc, positions, cache_loc_2d=None,
                                                 commit_lens=None, extend_lens=None) -> None:
        """Upstream writes a prefill's prompt context to the draft KV inside its prefill (its only call with
        ``extend_lens``): kept for the next flush instead (steps/draft_kv.py, before the first draft reads it), so
        the first token does not wait for the drafter's projection of every prompt token, and a request that never
        drafts does not pay it at its prefill."""
        batch = self._prefill
        if (extend_lens is not None and batch is not None and cache_loc_2d is None and batch.extend_lens is not None
                and len(batch.extend_lens) == len(batch.reqs)
                and self.draft_kv.defer_prompt(target_hidden[: cache_loc.numel()], cache_loc, positions,
                                               batch.reqs, batch.extend_lens)):
            return
        self.draft_kv.written(cache_loc)  # a row parked for one of these slots is stale (steps/draft_kv.py)
        super()._append_target_hidden_to_draft_kv_by_loc(
            target_hidden=target_hidden, cache_loc=cache_loc, positions=positions, cache_loc_2d=cache_loc_2d,
            commit_lens=commit_lens, extend_lens=extend_lens)

    # -- feedback (host side, after SGLang's copy-done sync): the loop's ------------------------------------------
    def on_verify_complete_cpu(self, num_correct_drafts_per_req: list[int], batch_size: int = 0) -> None:
        self.loop.complete(num_correct_drafts_per_req, batch_size)

    def drafter_swapped(self, version: str | None) -> None:
        """The drafter's weights were replaced in place (patches/drafter_swap.py, after SGLang's weight update).

        Upstream's fused context-KV helper (GPU) holds copies of the old K/V projections: rebuilt from the new
        parameters. The draft KV already written for running requests and cached prefixes is kept, neither rebuilt
        (the target's hidden states it came from are gone) nor invalidated: the next drafts of those requests read a
        context the old drafter wrote; every draft is still verified by the target, so the output is unchanged
        (tests/integration/test_learning.py). The controller keeps the old drafter's acceptance as a light prior
        (BlockSizeController.drafter_changed)."""
        if getattr(self, "_fused_kv_helper", None) is not None:
            self._init_fused_kv_helper()
        self.loop.drafter_swapped(version)
        logger.info("dflash-serve: drafter weights replaced (version %s); acceptance priors softened", version)

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        self.loop.request_finished(rid)
