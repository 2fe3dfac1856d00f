"""DFlash verify samples what plain decoding samples: per-row penalties, min_new_tokens and min_p (all devices).

SGLang 0.5.23 (DFLASH and DFLASH_ADAPTIVE alike; found through the server: greedy requests with
repetition_penalty 1.3, frequency_penalty 1.0 or presence_penalty 1.0 returned other tokens than plain decoding on
6 of 6 code prompts, and with min_p 0.5 at temperature 1, 505 of 768 sampled tokens were ones min_p forbids):

1. **Penalties are never applied in verify.** The scheduler runs the worker on `SamplingBatchInfo.copy_for_forward()`,
   whose `penalizer_orchestrator` is None (its accumulated penalties sit in `acc_additive_penalties` /
   `acc_scaling_penalties`); `dflash_utils.apply_dflash_verify_logits_adjustments` looks for `acc_linear_penalties`,
   which no longer exists, and for the orchestrator, which is gone. Had they been found, one row would have been
   broadcast over the whole block, so row j would not see the block's own earlier tokens.
2. **Penalizers never see DFlash's output.** Plain decoding cumulates the last output token in
   `ScheduleBatch.prepare_for_decode`; the spec path returns before that (`spec_prepare_for_decode`), and
   `DFlashDraftInputV2.prepare_for_decode` does not do it either. So penalties would stay at their initial state and
   min_new_tokens would ban EOS forever.
3. **min_p is not applied** by `dflash_utils.build_speculative_verify_target_probs`; and on CPU (SGLang's pytorch
   sampler) top-p is cut on the unrenormalised sorted probabilities, while verify cut it after top-k renormalisation:
   another distribution whenever both are set.

The fix (each piece one wrap; the math is sglang_ext/verify_rows.py, shared by every device):
  * `SamplingBatchInfo.copy_for_forward`: the copy keeps a reference to the scheduler's orchestrator;
  * `spec_utils.spec_prepare_for_decode`: for the DFlash family, cumulate every output token committed since the
    last step except the anchor (one round per token, as plain decoding's one-per-step);
  * `dflash_utils.apply_dflash_verify_logits_adjustments` (and its name in dflash_worker_v2): custom logit
    processors only -- penalties and logit_bias move to the accept, where the candidates are known;
  * `DFlashWorkerV2._can_skip_verify_logits`: never skip the logits when penalties are active (upstream decides
    from the copy, which says none are);
  * `DFlashWorkerV2._accept_block`: row-j penalties (state + the block's first j + 1 tokens), then logit_bias, then
    upstream's accept; afterwards the committed tokens are left for the next step's cumulation;
  * `dflash_utils.build_speculative_verify_target_probs`: the pytorch sampler's distribution (temperature, top-k,
    top-p, min_p) on CPU; upstream's renormalised one plus min_p elsewhere.
What the overlap scheduler breaks (the next step launches before this step's tokens reach `req.output_ids`):
penalties under DFlash with overlap are refused per request with a 400 naming the parameter
(patches/request_validation.py), as are custom logit processors and sampling seeds.
Retired by: upstream cumulating committed tokens in DFlash's decode preparation, replaying penalties per verify row
from the orchestrator it passes to the worker, and applying min_p in build_speculative_verify_target_probs.
"""
from __future__ import annotations

from types import ModuleType

from sglang_ext.patches.wrap import when_imported, wrap

ORCHESTRATOR = "dflash_serve_orchestrator"  # the scheduler's penalizer orchestrator, on the worker's copy


def _patch_sampling_batch_info(sbi: ModuleType) -> None:
    def make(original):
        def copy_for_forward(self):
            copy = original(self)
            orchestrator = self.penalizer_orchestrator
            setattr(copy, ORCHESTRATOR, orchestrator if orchestrator is not None and orchestrator.is_required else None)
            return copy

        return copy_for_forward

    wrap(sbi.SamplingBatchInfo, "copy_for_forward", make)


def _cumulate_committed(batch) -> None:
    """Feed the penalizers every output token committed since the last step but the newest (the anchor)."""
    import torch

    from sglang_ext import verify_rows

    sampling_info = batch.sampling_info
    orchestrator = getattr(sampling_info, "penalizer_orchestrator", None)
    if orchestrator is None or not orchestrator.is_required or batch.enable_overlap:
        return
    pending = []
    for req in batch.reqs:
        done = getattr(req, "dflash_serve_cumulated", 0)
        upto = max(len(req.output_ids) - 1, done)
        pending.append(req.output_ids[done:upto])
        req.dflash_serve_cumulated = upto
    rounds = max((len(p) for p in pending), default=0)
    if rounds == 0:
        return
    tokens = torch.zeros((len(pending), rounds), dtype=torch.int64)
    mask = torch.zeros((len(pending), rounds), dtype=torch.bool)
    for r, toks in enumerate(pending):
        tokens[r, : len(toks)] = torch.tensor(toks, dtype=torch.int64)
        mask[r, : len(toks)] = True
    device = orchestrator.device
    verify_rows.cumulate_rounds(orchestrator, tokens.to(device), mask.to(device))


def _patch_spec_utils(su: ModuleType) -> None:
    def make(original):
        def spec_prepare_for_decode(batch):
            if batch.spec_algorithm.is_dflash_family():
                _cumulate_committed(batch)
            return original(batch)

        return spec_prepare_for_decode

    wrap(su, "spec_prepare_for_decode", make)  # schedule_batch imports it at call time


def _patch_dflash_utils(du: ModuleType) -> None:
    def make_adjustments(original):
        def apply_dflash_verify_logits_adjustments(*, next_token_logits, sampling_info, draft_token_num):
            # penalties and logit_bias are the accept's (row-aware, in plain decoding's order)
            if sampling_info is not None and sampling_info.has_custom_logit_processor:
                du.apply_custom_logit_processor(next_token_logits, sampling_info,
                                                num_tokens_in_batch=draft_token_num)

        return apply_dflash_verify_logits_adjustments

    def make_target_probs(original):
        def build_speculative_verify_target_probs(*, next_token_logits, sampling_info, draft_token_num, bs,
                                                  **kwargs):
            from sglang.srt.runtime_context import get_exec

            from sglang_ext import verify_rows

            need_min_p = bool(getattr(sampling_info, "need_min_p_sampling", False))
            if get_exec().kernel.sampling_backend == "pytorch":
                probs = verify_rows.sampler_probs(next_token_logits, sampling_info,
                                                  lambda t: t.repeat_interleave(draft_token_num, dim=0))
                return probs.view(bs, draft_token_num, -1).contiguous()
            probs = original(next_token_logits=next_token_logits, sampling_info=sampling_info,
                             draft_token_num=draft_token_num, bs=bs, **kwargs)
            if need_min_p:
                min_ps = sampling_info.min_ps.repeat_interleave(draft_token_num, dim=0)
                probs = verify_rows.apply_min_p(probs.view(bs * draft_token_num, -1), min_ps)
                probs = probs.view(bs, draft_token_num, -1).contiguous()
            return probs

        return build_speculative_verify_target_probs

    wrap(du, "apply_dflash_verify_logits_adjustments", make_adjustments)
    wrap(du, "build_speculative_verify_target_probs", make_target_probs)


def _patch_worker(w: ModuleType) -> None:
    import importlib

    du = importlib.import_module("sglang.srt.speculative.dflash_utils")
    _patch_dflash_utils(du)
    w.apply_dflash_verify_logits_adjustments = du.apply_dflash_verify_logits_adjustments  # imported by name

    def make(original):
        def _accept_block(self, *, candidates, next_token_logits, sampling_info, **kwargs):
            if next_token_logits is not None and sampling_info is not None:
                from sglang_ext import verify_rows

                bs, width = candidates.shape
                verify_rows.apply_accept_adjustments(next_token_logits.view(bs, width, -1), candidates, sampling_info,
                                                     getattr(sampling_info, ORCHESTRATOR, None))
            return original(self, candidates=candidates, next_token_logits=next_token_logits,
                            sampling_info=sampling_info, **kwargs)

        return _accept_block

    wrap(w.DFlashWorkerV2, "_accept_block", make)

    def make_skip(original):
        def _can_skip_verify_logits(self, batch, sampling_info) -> bool:
            # upstream decides from the copy, whose orchestrator is None: penalties need the logits
            if sampling_info is not None and getattr(sampling_info, ORCHESTRATOR, None) is not None:
                return False
            return original(self, batch, sampling_info)

        return _can_skip_verify_logits

    wrap(w.DFlashWorkerV2, "_can_skip_verify_logits", make_skip)


def install() -> None:
    when_imported("sglang.srt.sampling.sampling_batch_info", _patch_sampling_batch_info)
    when_imported("sglang.srt.speculative.spec_utils", _patch_spec_utils)
    when_imported("sglang.srt.speculative.dflash_utils", _patch_dflash_utils)
    when_imported("sglang.srt.speculative.dflash_worker_v2", _patch_worker)
