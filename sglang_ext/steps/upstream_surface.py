"""What the decode steps read and call on the worker: upstream DFlashWorkerV2's members
(sglang/srt/speculative/dflash_worker_v2.py) and the few the adaptive worker adds, each with its type.

The steps reach most of these by their private names: this is the list an SGLang upgrade must re-check
(tests/unit/test_upstream_surface.py compares it with the installed SGLang's class and with worker.py;
docs/UPGRADING_SGLANG.md). Types only: nothing here runs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from sglang.srt.configs.draft_parallel import DraftParallelLayout
    from sglang.srt.layers.logits_processor import LogitsProcessor
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.mem_cache.kv_loc_plan import KVLocPlan
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.models.dflash import DFlashDraftModel
    from sglang.srt.speculative.dflash_info_v2 import DFlashDraftInputV2
    from sglang.srt.speculative.spec_tp_sync import SpecTpSync

    from sglang_ext.controller_loop import ControllerLoop
    from sglang_ext.steps.draft_kv import DraftKV


class UpstreamWorker(Protocol):
    """Upstream DFlashWorkerV2's members the steps use (attributes set in its ``__init__`` unless noted)."""

    # -- models, runners, devices
    device: str  # the target's device ("cuda", "cpu")
    model_runner: ModelRunner  # the target's runner: req_to_token_pool, token_to_kv_pool
    draft_model_runner: ModelRunner  # the drafter's runner: its forward, its kv_index_translator
    draft_model: DFlashDraftModel  # the drafter module (DFlash2: DFlash2DraftModel, with grouped convolutions)
    draft_parallel_layout: DraftParallelLayout | None  # the drafter's TP layout: upstream.draft_tp_context's input
    selector: Any | None  # DFlash2's CandidateSelector (draft_model.candidate_selector); None for DFlash
    _tp_sync: SpecTpSync  # broadcasts a step's sampled tokens from TP rank 0 (SpecTpSyncSite per call)

    @property
    def target_worker(self) -> TpModelWorker:  # BaseSpecWorker's property: the target's TpModelWorker
        ...

    # -- the block: width, window buffers, mask token
    block_size: int  # the trained block B; steps set it to the verify width around upstream's accept
    _mask_token_id: int  # the drafter's mask token: a window's input past the anchor
    _block_pos_offsets: torch.Tensor  # [B] 0 .. B - 1 on the device: the window's positions past the prefix
    _draft_block_ids_buf: torch.Tensor | None  # [cap, B] the window's input ids (sized by _ensure_draft_block_buffers)
    _draft_block_positions_buf: torch.Tensor | None  # [cap, B] the window's positions
    _draft_block_tokens_buf: torch.Tensor | None  # [cap, B] the anchor and the drafted block (verify candidates)
    _draft_verify_out_cache_loc_buf: torch.Tensor | None  # [cap, B] the window's KV slots
    _draft_seq_lens_cpu_buf: torch.Tensor | None  # [cap] host KV lengths of the draft forward
    _use_triton_prepare_block: bool  # Triton block preparation (GPU); set False for good when it fails

    def _ensure_draft_block_buffers(self, bs: int) -> None:  # (re)sizes the [cap, B] window buffers for bs
        ...

    # -- the draft forward
    _full_embed_gpu: torch.Tensor | None  # the full embedding matrix on the device (TP: gathered), else None
    _noise_embed_scale: float  # the target's scale of the drafter's input embeddings (1.0 for most)
    _draft_sampler: Any | None  # the draft graph's in-graph head (_DflashDraftSampler, _SelectorDraftSampler): GPU
    _selector_sampling_enabled: bool  # a DFlash2 path may be sampled (False on NPU)
    # DFlash2's q (candidate ids, probabilities per drafted position) of a sampled path: read by _accept_block and
    # _can_skip_verify_logits; the chain step sets it for its verify only (steps/chain.py)
    _selector_sample: tuple[torch.Tensor, torch.Tensor] | None

    def _greedy_sample_from_vocab_parallel_head(self, *, hidden_states: torch.Tensor, lm_head: Any,
                                                chunk_size: int = 256) -> torch.Tensor:  # TP-safe argmax
        ...

    def _propose_selector_block(self, *, draft_logits_output: Any, bs: int, lm_head: Any,
                                anchor_token_ids: torch.Tensor, sampling_info: Any) -> torch.Tensor:
        ...  # DFlash2's eager path walk over block_size - 1 positions; a sampled path's q to _selector_sample

    # -- the verify and its accept
    _target_logits_processor: LogitsProcessor | None  # the target's processor, its verify gather deferred
    _need_mamba_verify_commit: bool  # a hybrid target (set in init_attention_backends): keep recurrent states

    def _can_skip_verify_logits(self, batch: ScheduleBatch, sampling_info: Any) -> bool:
        ...  # greedy with nothing applied to the logits: the verify's argmax suffices

    def _accept_block(self, *, candidates: torch.Tensor, next_token_logits: torch.Tensor, sampling_info: Any,
                      draft_input: DFlashDraftInputV2, prefix_lens: torch.Tensor, bs: int,
                      target_predict: torch.Tensor | None = None) -> Any:
        ...  # -> (accept_len, commit_lens, bonus, out_tokens, new_seq_lens | None) at width block_size

    def _update_target_mamba_state_after_verify(self, *, batch: ScheduleBatch, seq_lens_pre_verify: torch.Tensor,
                                                seq_lens_post_verify: torch.Tensor,
                                                commit_lens: torch.Tensor) -> None:
        ...  # a hybrid target: keep the accepted prefix's recurrent state

    def _make_next_draft_input_decode(self, *, bonus_tokens: torch.Tensor,
                                      new_seq_lens: torch.Tensor) -> DFlashDraftInputV2:
        ...  # the batch's draft state for the next step

    def _draft_write_ids(self, plan: KVLocPlan) -> torch.Tensor:
        ...  # a target forward's KV slots as draft-pool ids (the plain step's draft-KV append)


class StepWorker(UpstreamWorker, Protocol):
    """The worker a step reads (``StepContext.worker``): upstream's members and the adaptive worker's own."""

    max_block: int  # the trained block B (block_size is upstream's, which the accept narrows)
    draft_kv: DraftKV  # the draft KV's writer, deferred appends included
    loop: ControllerLoop  # the feedback loop: a step hands it its LaunchedStep
    _prefix_drafts: bool  # the draft runs over the verify width only (CPU: the draft is eager)
    _draft_spec_info_by_width: dict[int, Any]  # the draft forward's spec info per width (B: upstream's own)
