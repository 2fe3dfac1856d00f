"""The GPU-only calls of the adaptive worker, pinned to the installed SGLang.

CUDA graph capture per verify width (sglang_ext/verify_runtimes.py) and the Triton/CUDA branches of the worker
cannot run on this machine. Every upstream name they call, and every keyword they pass, is checked here against
the installed SGLang's signatures, so an upgrade that renames or reshapes one fails CI instead of a GPU server.
"""
from __future__ import annotations

import json

from tests.conftest import child_result

# (importable path of a callable, keyword / positional names the plugin passes to it)
CALLS = [
    # verify_runtimes.capture_verify_runtimes
    ("sglang.srt.model_executor.model_runner:ModelRunner._get_attention_backend", ["init_new_workspace"]),
    ("sglang.srt.model_executor.runner:DecodeCudaGraphRunner.__init__",
     ["model_runner", "attn_backend", "speculative_num_steps", "speculative_num_draft_tokens"]),
    ("sglang.srt.mem_cache.kv_index_translator:KVIndexTranslator.bind_and_verify_backends", ["backends"]),
    ("sglang.srt.model_executor.cuda_graph_config:check_cuda_graph_backend", ["phase", "backend"]),
    ("sglang.srt.runtime_context:RuntimeContext.override", ["source", "speculative_num_draft_tokens"]),
    ("sglang.srt.model_executor.runner:DecodeCudaGraphRunner.get_spec_info", ["num_tokens"]),  # a tree's capture
    ("sglang.srt.model_executor.cuda_graph_config:with_phase", ["config", "phase"]),  # a tree's batch sizes
    # worker: prewarm of chain-verify buffers per width (CUDA)
    ("sglang.srt.speculative.dflash_worker_v2:_get_or_create_chain_verify_buffers", ["bs", "draft_token_num", "device"]),
    ("sglang.srt.speculative.dflash_worker_v2:DFlashWorkerV2._prewarm_batch_size", ["block_size"]),
    # worker: Triton block preparation (CUDA) and its eager fallback
    ("sglang.srt.speculative.dflash_worker_v2:_prepare_dflash_draft_block_unchecked",
     ["bonus_tokens", "prefix_lens", "req_pool_indices", "req_to_token", "block_ids_out", "positions_out",
      "cache_loc_out", "mask_token_id"]),
    ("sglang.srt.speculative.dflash_worker_v2:assign_extend_cache_locs_func",
     ["req_pool_indices", "req_to_token", "start_offset", "end_offset", "batch_size", "draft_token_num", "device"]),
    # worker: the decode step (shared by CPU and GPU; pinned so the GPU branches stay in step)
    ("sglang.srt.mem_cache.kv_index_translator:KVIndexTranslator.plan",
     ["req_pool_indices", "seq_lens", "seq_lens_cpu", "write_virtual", "read_extent"]),
    ("sglang.srt.mem_cache.kv_loc_plan:KVLocPlan.write_ids", ["reader", "cols"]),
    ("sglang.srt.mem_cache.kv_loc_plan:KVLocPlan.bind", ["batch", "reader"]),
    ("sglang.srt.speculative.dflash_info:DFlashVerifyInput.__init__",
     ["draft_token", "positions", "draft_token_num", "custom_mask", "capture_hidden_mode", "kv_loc_plan",
      "kv_loc_cols"]),
    ("sglang.srt.speculative.dflash_info:DFlashVerifyInput.prepare_for_verify",
     ["batch", "target_worker", "defer_metadata_init"]),
    ("sglang.srt.speculative.dflash_worker_v2:DFlashWorkerV2._accept_block",
     ["candidates", "next_token_logits", "sampling_info", "draft_input", "prefix_lens", "bs", "target_predict"]),
    ("sglang.srt.speculative.dflash_worker_v2:DFlashWorkerV2._next_accept_bonus_buffers", ["bs"]),
    ("sglang.srt.speculative.dflash_worker_v2:DFlashWorkerV2._append_target_hidden_to_draft_kv_by_loc",
     ["target_hidden", "cache_loc", "cache_loc_2d", "positions", "commit_lens", "extend_lens"]),
    ("sglang.srt.speculative.dflash_worker_v2:DFlashWorkerV2._greedy_sample_from_vocab_parallel_head",
     ["hidden_states", "lm_head"]),
    ("sglang.srt.speculative.dflash_worker_v2:DFlashWorkerV2._make_next_draft_input_decode",
     ["bonus_tokens", "new_seq_lens"]),
    ("sglang.srt.speculative.dflash_worker_v2:DFlashWorkerV2.forward_batch_generation",
     ["batch", "on_publish", "grammar_barrier", "pp_proxy_tensors"]),
    ("sglang.srt.speculative.dflash_worker_v2:apply_dflash_verify_logits_adjustments",
     ["next_token_logits", "sampling_info", "draft_token_num"]),
    ("sglang.srt.speculative.dflash_worker_v2:SpeculativeSamplingMaskCapture.from_logits",
     ["sampling_info", "next_token_logits", "draft_input", "draft_token_num", "bs"]),
    ("sglang.srt.speculative.dflash_worker_v2:compute_spec_logprobs", ["batch", "logits_output", "chain_stride"]),
    ("sglang.srt.speculative.dflash_worker_v2:build_grammar_vocab_mask",
     ["reqs", "tree", "sampling_info", "device", "barrier"]),
    ("sglang.srt.speculative.dflash_worker_v2:GenerationBatchResult.__init__",
     ["logits_output", "next_token_ids", "accept_lens", "can_run_cuda_graph", "next_draft_input",
      "speculative_num_draft_tokens", "new_seq_lens", "routed_experts_output", "indexer_topk_output"]),
    # worker: a tree on GPU (verify_runtimes.tree_verify_refusal resolves the verify backend as upstream does)
    ("sglang.srt.speculative.dflash_utils:resolve_dflash_verify_mask_policy", ["attn_backend"]),
    # a DFlash2 drafter (steps/draft.py selector_path; worker._selector_sampling_accept)
    ("sglang.srt.speculative.dflash_worker_v2:_SelectorDraftSampler.stage_sampling_params", ["bs", "sampling_info"]),
    ("sglang.srt.speculative.dflash_worker_v2:DFlashWorkerV2._propose_selector_block",
     ["draft_logits_output", "bs", "lm_head", "anchor_token_ids", "sampling_info"]),
    ("sglang.srt.speculative.dflash_worker_v2:DFlashWorkerV2._selector_sampling_accept",
     ["candidates", "next_token_logits", "candidate_ids", "q_rows", "sampling_info", "draft_input"]),
    # a width-1 step as plain decoding (steps/plain.py, patches/plain_decode.py)
    ("sglang.srt.mem_cache.allocation_sizing:page_aligned_decode_alloc_lens", ["reqs", "reserve", "page_size"]),
    ("sglang.srt.mem_cache.allocation:alloc_for_spec_decode",
     ["tree_cache", "req_to_token_pool", "reqs", "req_pool_indices", "cur_kv_lens", "cur_kv_lens_cpu", "nxt_kv_lens",
      "nxt_kv_lens_cpu", "num_needed_tokens", "batch"]),
    ("sglang.srt.managers.tp_worker:TpModelWorker.forward_batch_generation",
     ["batch", "capture_hidden_mode", "return_kv_loc_plan"]),
    ("sglang.srt.speculative.draft_worker_common:make_draft_input_v2", ["bonus_tokens", "new_seq_lens"]),
    ("sglang.srt.managers.scheduler_components.metrics_reporter:SchedulerMetricsReporter.update_spec_metrics",
     ["bs", "num_correct_drafts", "num_accept_tokens"]),
    ("sglang.srt.managers.scheduler:Scheduler.update_running_batch", ["batch"]),
    ("sglang.srt.managers.scheduler:Scheduler.process_batch_result", ["batch", "result"]),
    # feedback hooks the scheduler calls on the worker
    ("sglang.srt.speculative.base_spec_worker:BaseSpecWorker.on_verify_complete_cpu",
     ["num_correct_drafts_per_req", "batch_size"]),
    ("sglang.srt.speculative.base_spec_worker:BaseSpecWorker.note_request_finished", ["rid", "natural_stop"]),
]

# attributes/source facts the plugin relies on: (module:object, substring of its source); None for the one set
# checked by value (upstream's skip-custom-mask backends hold the two the GPU tree verifies on)
SOURCES = [
    # the prompt context: upstream's prefill writes it through the one call with extend_lens, which the worker's
    # override keeps for the next draft (steps/draft_kv.py); a request's slots are its own until it finishes, is
    # retracted or hands its KV record on
    ("sglang.srt.speculative.dflash_worker_v2:DFlashWorkerV2.forward_batch_generation", "extend_lens=ctx_lens,"),
    ("sglang.srt.managers.schedule_batch:Req.reset_for_retract", "self.is_retracted = True"),
    ("sglang.srt.managers.schedule_batch:Req.detach_kv", "kv, self.kv = self.kv, ReqKvInfo()"),
    ("sglang.srt.managers.schedule_batch:Req.finished", "return self.finished_reason is not None"),
    # a stale parked row goes to the pool's padding slot 0, which the allocator never hands out
    ("sglang.srt.mem_cache.allocator.token:TokenToKVPoolAllocator.clear",
     "# The padded slot 0 is used for writing dummy outputs from padded tokens."),
    ("sglang.srt.mem_cache.allocator.paged:PagedTokenToKVPoolAllocator.clear",
     "# The padded slot 0 is used for writing dummy outputs from padded tokens."),
    # a plain decode step: the running batch's decode preparation is update_running_batch's last call (after
    # retraction); run_batch's plain branch calls the same worker; the plain result path keys on the batch's own
    # algorithm; the plain preparation's slot bookkeeping is what alloc_for_decode_default keeps
    ("sglang.srt.managers.scheduler:Scheduler.update_running_batch", "batch.prepare_for_decode()\n        return batch"),
    ("sglang.srt.managers.scheduler:Scheduler.run_batch",
     "batch_result = self.model_worker.forward_batch_generation(\n                    batch, **kwargs"),
    ("sglang.srt.managers.scheduler_components.batch_result_processor:SchedulerBatchResultProcessor.process_batch_result_decode",
     "if not batch.spec_algorithm.is_none():\n            self.metrics_reporter.update_spec_metrics("),
    ("sglang.srt.mem_cache.allocation:alloc_for_decode_default", "req.kv.kv_committed_len += token_per_req"),
    ("sglang.srt.managers.scheduler:Scheduler._forward_isolation", "snapshot_v2_full = not batch.spec_algorithm.is_none()"),
    # the scheduler feeds accept counts to the worker after its copy-done sync (no sync of our own needed)
    ("sglang.srt.managers.scheduler_components.batch_result_processor:SchedulerBatchResultProcessor._resolve_spec_v2_tokens",
     "self.model_worker.on_verify_complete_cpu("),
    ("sglang.srt.managers.scheduler_components.batch_result_processor:SchedulerBatchResultProcessor.process_batch_result_decode",
     "result.copy_done.synchronize()"),
    # the scheduler's row stride of next_token_ids is the result's width
    ("sglang.srt.managers.scheduler_components.batch_result_processor:_get_speculative_output_stride",
     "result.speculative_num_draft_tokens"),
    # upstream's greedy accept reads self.block_size as the verify width (the worker sets it around the call)
    ("sglang.srt.speculative.dflash_worker_v2:DFlashWorkerV2._accept_block",
     "target_predict.view(bs, int(self.block_size))"),
    # per-request KV reservation uses the published (maximum) width, which the worker never changes
    ("sglang.srt.speculative.dflash_info_v2:DFlashDraftInputV2.prepare_for_decode",
     "speculative_num_draft_tokens"),
    ("sglang.srt.model_executor.model_runner:ModelRunner.__init__", "self.init_new_workspace"),
    # the KV pool is sized before the spec worker captures its graphs; post-capture sizing backs it afterwards and
    # says so on the pool (the worker warns when it is off), enabled by the variable the launcher sets
    ("sglang.srt.managers.scheduler:Scheduler.init_model_worker", "self.init_memory_pools()"),
    ("sglang.srt.managers.scheduler:Scheduler.init_model_worker",
     "if model_runner.token_to_kv_pool.post_capture_active:"),
    ("sglang.srt.environ:Envs", "SGLANG_ENABLE_POST_CAPTURE_KV_SIZING = EnvBool("),
    # a tree on GPU verifies with its mask in DFlashVerifyInput.custom_mask (verify_runtimes.py):
    # - upstream sizes that mask as tree/mask.py packed lays it out, and hands it to the attention backend
    ("sglang.srt.speculative.dflash_info:DFlashVerifyInput.generate_attn_arg_prefill",
     "paged_kernel_lens_sum * self.draft_token_num"),
    ("sglang.srt.speculative.dflash_info:DFlashVerifyInput.generate_attn_arg_prefill",
     "+ (self.draft_token_num**2) * bs"),
    ("sglang.srt.speculative.dflash_info:DFlashVerifyInput.generate_attn_arg_prefill",
     "return kv_indices, cum_kv_seq_len, qo_indptr, mask"),
    # - FlashInfer plans the verify with it; Triton reads it at n * (prefix + n) per request
    ("sglang.srt.layers.attention.flashinfer_backend:FlashInferIndicesUpdaterPrefill.call_begin_forward",
     "custom_mask=use_custom_mask,"),
    ("sglang.srt.layers.attention.flashinfer_backend:FlashInferIndicesUpdaterPrefill.call_begin_forward",
     "use_custom_mask = custom_mask"),
    ("sglang.srt.layers.attention.triton_backend:TritonAttnBackend.init_forward_metadata",
     "custom_mask = spec_info.custom_mask"),
    ("sglang.srt.layers.attention.triton_backend:TritonAttnBackend.init_forward_metadata",
     "forward_batch.seq_lens + num_tokens_per_req"),
    # - a verify graph refuses any width but its own (an uncaptured width plans eagerly); a captured one is loaded
    ("sglang.srt.model_executor.runner.decode_cuda_graph_runner:DecodeCudaGraphRunner.can_run_graph",
     "spec_info.num_tokens_per_req != self.captured_req_width"),
    ("sglang.srt.speculative.dflash_info:DFlashVerifyInput.prepare_for_verify",
     "target_worker.model_runner.attn_backend.init_forward_metadata("),
    ("sglang.srt.speculative.dflash_info:DFlashVerifyInput.prepare_for_verify",
     "decode_cuda_graph_runner.load_batch("),
    # - a graph per tree width, captured with the mask: upstream's capture input leaves it out for DFLASH on these
    #   backends (so a chain's graph is causal), and the tree runner puts the runner's buffer back in
    #   (tree_graph_runner_class overrides get_spec_info, which capture_prepare calls for each batch size)
    ("sglang.srt.model_executor.runner.decode_cuda_graph_runner:DecodeCudaGraphRunner",
     "if (self.model_runner.is_draft_worker or not build_custom_mask)"),
    ("sglang.srt.speculative.dflash_utils:_DFLASH_VERIFY_SKIP_CUSTOM_MASK_BACKENDS", None),
    ("sglang.srt.model_executor.runner.decode_cuda_graph_runner:DecodeCudaGraphRunner.capture_prepare",
     "spec_info = self.get_spec_info(num_tokens)"),
    # - FlashInfer: a capture input with a mask builds the width's verify wrappers around the custom-mask buffer;
    #   the sync-free fast plan is installed only for maskless DFLASH graphs, so a tree graph re-plans with the
    #   step's mask at every replay (plan() refills the buffer), and planning a masked graph without one raises
    ("sglang.srt.layers.attention.flashinfer_backend:FlashInferAttnBackend._prepare_cuda_graph_metadata",
     'and getattr(spec_info, "custom_mask", None) is not None'),
    ("sglang.srt.layers.attention.flashinfer_backend:FlashInferAttnBackend.init_forward_metadata_out_graph",
     'and getattr(spec_info, "custom_mask", None) is None'),
    ("sglang.srt.layers.attention.flashinfer_backend:FlashInferIndicesUpdaterPrefill.call_begin_forward",
     "verify planned without a custom mask on"),
    # - Triton: captured with its verify-mask buffer when the capture input has a mask, filled from the step's
    #   mask at every replay
    ("sglang.srt.layers.attention.triton_backend:TritonAttnBackend._build_cuda_graph_forward_metadata",
     "self._verify_mask.buffer"),
    ("sglang.srt.layers.attention.triton_backend:TritonAttnBackend._update_target_verify_buffers",
     "custom_mask[: spec_info.custom_mask.shape[0]] = spec_info.custom_mask"),
    # - a replay padded to a captured batch size pads the mask (all ones: the padded rows are discarded)
    ("sglang.srt.speculative.dflash_info:DFlashVerifyInput.generate_attn_arg_prefill",
     "if mask.numel() < mask_numel:"),
    # - a tree's graphs stop where its rows outgrow the shared logits buffer, sized for the published width: the
    #   runner takes its batch sizes from the published graph config and its logits rows from that buffer, which
    #   refuses more rows than it holds; a batch above the runner's largest size verifies eagerly
    ("sglang.srt.model_executor.runner.base_cuda_graph_runner:get_batch_sizes_to_capture",
     "capture_bs = list(get_exec().graph.cuda_graph_config.decode.bs)"),
    ("sglang.srt.model_executor.runner.decode_cuda_graph_runner:DecodeCudaGraphRunner.__init__",
     "self.capture_bs, self.compile_bs = get_batch_sizes_to_capture("),
    ("sglang.srt.model_executor.runner.decode_cuda_graph_runner:DecodeCudaGraphRunner.__init__",
     "self.model_runner.graph_shared_output.get_logits_buffer("),
    ("sglang.srt.model_executor.graph_shared_output:GraphSharedOutput.get_logits_buffer",
     "assert rows <= self.max_rows"),
    ("sglang.srt.model_executor.model_runner:ModelRunner.max_decode_logits_rows",
     "max_rows = max(max_rows, max(capture_bs) * num_tokens_per_req)"),
    ("sglang.srt.model_executor.runner.decode_cuda_graph_runner:DecodeCudaGraphRunner.can_run_graph",
     "else cuda_graph_bs <= self.max_bs"),
    # - no metadata glue graph for DFLASH (it would freeze the capture-time plan, mask included)
    ("sglang.srt.model_executor.runner.decode_cuda_graph_runner:DecodeCudaGraphRunner.__init__",
     "if enable_metadata_glue and model_runner.spec_algorithm.is_dflash_family():"),
    # a DFlash2 drafter on GPU: the draft graph's in-graph walk leaves the path, its candidates and q in the
    # sampler's buffers, and upstream's accept reads the q from `_selector_sample` (steps/chain.py sets it)
    ("sglang.srt.speculative.dflash_worker_v2:_SelectorDraftSampler.__call__", "self.candidate_out[:bs].copy_("),
    ("sglang.srt.speculative.dflash_worker_v2:_SelectorDraftSampler.__call__", "self.q_out[:bs].copy_(q_rows)"),
    ("sglang.srt.speculative.dflash_worker_v2:DFlashWorkerV2._accept_block",
     "selector_candidate_ids, selector_q_rows = self._selector_sample"),
    # - the dense q buffer is re-made only when its shape differs: a [cap, gamma, vocab] view of one buffer passes
    ("sglang.srt.speculative.dflash_worker_v2:DFlashWorkerV2._selector_sampling_accept",
     "buffer.shape[1:] != (gamma, vocab)"),
    # - the eager walk leaves a sampled path's q on the worker, where steps/draft.py takes it into its Draft
    ("sglang.srt.speculative.dflash_worker_v2:DFlashWorkerV2._propose_selector_block",
     "self._selector_sample = (candidate_ids, q_rows)"),
    # - the eager walk reads the drafted block's hidden states at self.block_size (the worker sets it to the width)
    ("sglang.srt.speculative.dflash_worker_v2:DFlashWorkerV2._propose_selector_block",
     "draft_hidden.view(bs, int(self.block_size), -1)"),
    # - the convolutions find a row's position in its block from their block_size (steps/draft.py conv_block_as)
    ("sglang.srt.models.dflash:DFlashGroupedConv._convolve", "self.block_size,"),
    # the chain-verify buffer cache is keyed by the device's index (the prewarm passes an indexed device)
    ("sglang.srt.speculative.dflash_utils:_get_or_create_chain_verify_buffers",
     "key = (device.index, int(draft_token_num))"),
]

PROBE = r"""
import importlib, inspect, json, sys
calls, sources = json.loads(sys.argv[1]), json.loads(sys.argv[2])

def resolve(path):
    mod, _, attr = path.partition(":")
    obj = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj

out = {"calls": {}, "sources": {}}
for path, names in calls:
    try:
        params = inspect.signature(resolve(path)).parameters
        var_kw = any(p.kind is p.VAR_KEYWORD for p in params.values())
        out["calls"][path] = [n for n in names if n not in params and not var_kw]
    except Exception as e:
        out["calls"][path] = f"{type(e).__name__}: {e}"
for path, needle in sources:
    key = f"{path} :: {needle}"
    try:
        obj = resolve(path)
        if needle is None:  # a value: the tree backends are in it
            from sglang_ext.refusals import TREE_MASK_BACKENDS
            out["sources"][key] = set(TREE_MASK_BACKENDS.values()) <= set(obj)
        else:
            out["sources"][key] = needle in inspect.getsource(obj)
    except Exception as e:
        out["sources"][key] = f"{type(e).__name__}: {e}"
from sglang.srt.arg_groups.arg_utils import namespace_of
from sglang.srt.server_args import ServerArgs
out["leaf"] = {"speculative_num_draft_tokens", "cuda_graph_config"} <= set(namespace_of(ServerArgs))
print("RESULT" + json.dumps(out))
"""


def _probe() -> dict:
    return child_result("-c", PROBE, json.dumps(CALLS), json.dumps(SOURCES))


def test_gpu_only_calls_match_installed_sglang():
    out = _probe()
    broken = {path: missing for path, missing in out["calls"].items() if missing != []}
    assert broken == {}, f"upstream signature changed (missing parameters): {broken}"
    stale = {path: ok for path, ok in out["sources"].items() if ok is not True}
    assert stale == {}, f"upstream behaviour the worker relies on changed: {stale}"
    assert out["leaf"], "speculative_num_draft_tokens or cuda_graph_config is no longer an overridable leaf"
