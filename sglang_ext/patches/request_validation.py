"""Client mistakes that SGLang 0.5.23 turns into a dead server or a 500, refused as 400 instead (all devices).

Found by the property-based run against the OpenAPI document (tests/integration/test_reliability_serving.py):

1. **Token ids outside the vocabulary kill the server.** `token_ids_logprob` is checked against the vocabulary,
   the prompt's own ids are not: `POST /v1/completions {"prompt": [-38721]}` (or `/generate` with `input_ids`, or
   an id >= vocab_size) reaches the scheduler, the target's embedding raises `IndexError: index out of range in
   self`, the scheduler dies and takes the server down (SIGQUIT -> kill_process_tree). Checked in
   `TokenizerManager._validate_one_request`, which every generate path calls per (sub-)request after
   tokenization; its ValueError becomes a 400.
2. **/v1/detokenize** with an id < 0 or >= 2**32 answered 500 ("out of range integral type conversion
   attempted"); the serving class's `_validate_request` hook (400 in SGLang's handler) now checks the ids.
3. **Malformed request structure** -> 500: `/generate` with `"input_embeds": [[]]` (IndexError in
   `GenerateReqInput.normalize_batch_and_arguments`; its `assert`s too: /v1/embeddings with a malformed
   batch answered 500 "The rid should be a list."), a chat request whose `rid` is a list (TypeError
   "unhashable type" in `TokenizerManager._init_req_state`), `/generate` with an unknown key in
   `session_params` (TypeError "Unexpected keyword argument" where `_create_tokenized_object` unpacks it).
   Errors raised there come from the request's shape, so they become the ValueError SGLang's handlers answer
   with 400 (in `_create_tokenized_object` only TypeError: it unpacks client dicts into constructors).
4. **More top logprobs than the vocabulary has kills the server.** `/generate` with `"return_logprob": true,
   "top_logprobs_num": 5000` on a 4096-token vocabulary: `torch.topk` in the sampler raises "selected index k out
   of range" in the scheduler (found by hand-written probes of the logprob fields, now rows of
   `loadtest/faults.py`; upstream
   sgl-project/sglang#40076, fix proposed in PR #40099, not in 0.5.23). Checked in the same per-request hook.
5. **A logprob_start_len below -1 kills the server.** `/generate` with `"return_logprob": true,
   "logprob_start_len": -5`: -1 means "no input logprobs", anything lower reaches an `assert` in the scheduler's
   `add_input_logprob_return_values` (AssertionError -> scheduler dead). Checked in the same hook.
6. **An empty prompt kills the server.** `/generate {"text": ""}` (alone, or an empty string in a batch whose other
   prompts are prefilled apart from it; SGLang refuses `"input_ids": []` and a completions prompt `""` itself)
   reaches the target's prefill with nothing to compute the first token from: `IndexError: index is out of
   bounds for dimension with size 0` in `LogitsProcessor._get_pruned_states`, scheduler dead (the "not
   reproduced" IndexError of earlier fuzz runs: schemathesis sends `"text": [..., ""]`, and whether the empty one
   shares a prefill batch is a matter of timing). Refused in the per-request hook: a prompt needs at least one token.
7. **Sampling DFlash cannot serve as plain decoding would** (DFLASH and DFLASH_ADAPTIVE only; see
   patches/verify_sampling.py, which makes every other sampling parameter lossless): a custom logit processor
   (verify rows after the first would see the request state of the first), and what sglang_ext/refusals.py
   rules lossy (a seed while sampling, penalties under the overlap scheduler). Refused with the parameter named and
   the fix, in `TokenizerManager._create_tokenized_object`, on the parameters SGLang serves: the operator's
   `preferred_sampling_params` merged there (`_validate_one_request` runs before that merge, so an operator's
   seed was served lossy without a word).
8. **A load format SGLang does not know kills the server.** ``/update_weights_from_disk`` (an admin route) with
   ``"load_format": "x"``: ``LoadConfig`` raises ValueError in the scheduler (``SchedulerWeightUpdaterManager.
   update_weights_from_disk``), the scheduler dies (found by the property-based run on every route). Refused there
   before the load: the handler answers 400 with the known formats. Retired when upstream validates
   ``load_format`` in the request.
"""
from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import Any

from sglang_ext.patches.wrap import when_imported, wrap
from sglang_ext.refusals import custom_logit_processor_refusal, is_dflash, request_sampling_refusal


def check_prompt_not_empty(input_ids) -> None:
    if isinstance(input_ids, list) and len(input_ids) == 0:
        raise ValueError("the prompt is empty: a prompt needs at least one token (send text, input_ids or "
                         "messages with content)")


def check_token_ids(input_ids, vocab_size: int, what: str = "prompt token id") -> None:
    if not input_ids:
        return
    low, high = min(input_ids), max(input_ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"{what} {bad} is outside the vocabulary; valid ids are 0 to {vocab_size - 1}")


def check_logprob_args(obj, vocab_size: int) -> None:
    """`obj`: one (sub-)request. top_logprobs_num counts tokens per position (0 to the vocabulary size);
    logprob_start_len is a prompt position or -1 for "no input logprobs"."""
    if not getattr(obj, "return_logprob", False):
        return
    k = getattr(obj, "top_logprobs_num", None)
    if _is_int(k) and not 0 <= k <= vocab_size:
        raise ValueError(f"top_logprobs_num {k} is out of range; valid values are 0 to the vocabulary size "
                         f"({vocab_size})")
    start = getattr(obj, "logprob_start_len", None)
    if _is_int(start) and start < -1:
        raise ValueError(f"logprob_start_len {start} is out of range; use a prompt position (>= 0) or -1 for no "
                         "input logprobs")


def check_custom_logit_processor(obj, server_args) -> None:
    why = custom_logit_processor_refusal(getattr(server_args, "speculative_algorithm", None),
                                         getattr(obj, "custom_logit_processor", None))
    if why is not None:
        raise ValueError(why)


def check_speculative_sampling(obj, server_args, preferred: Mapping[str, Any] | None) -> None:
    """Refuse sampling DFlash would serve differently from plain decoding (a 400 naming the parameter), judged on
    the parameters the request is served with: the operator's `preferred` defaults under the request's own, as
    `_create_tokenized_object` merges them (the model's generation_config defaults are in a chat request's
    already). The same rule refuses such defaults at start-up (service/preflight.py)."""
    if not is_dflash(getattr(server_args, "speculative_algorithm", None)):
        return
    params = getattr(obj, "sampling_params", None)
    if not isinstance(params, dict):
        return
    why = request_sampling_refusal({**(preferred or {}), **params},
                                   overlap=not getattr(server_args, "disable_overlap_schedule", False))
    if why is not None:
        raise ValueError(why)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _patch_tokenizer_manager(tm_module: ModuleType) -> None:
    def make(original):
        def _validate_one_request(self, obj, input_ids):
            vocab_size = getattr(getattr(self, "model_config", None), "vocab_size", None)
            check_prompt_not_empty(input_ids)
            if vocab_size and input_ids is not None and not isinstance(input_ids, (str, bytes)):
                check_token_ids(input_ids, vocab_size)
            if vocab_size:
                check_logprob_args(obj, vocab_size)
            check_custom_logit_processor(obj, getattr(self, "server_args", None))
            return original(self, obj, input_ids)

        return _validate_one_request

    wrap(tm_module.TokenizerManager, "_validate_one_request", make)
    wrap(tm_module.TokenizerManager, "_init_req_state", _shape_errors_are_client_errors)
    wrap(tm_module.TokenizerManager, "_create_tokenized_object", _effective_sampling_checked)


def _effective_sampling_checked(original):
    # SGLang merges preferred_sampling_params into the request in here; the check sees what will be served
    shape_checked = _shape_errors_are_client_errors(original, (TypeError,))

    def _create_tokenized_object(self, obj, *args, **kwargs):
        check_speculative_sampling(obj, getattr(self, "server_args", None),
                                   getattr(self, "preferred_sampling_params", None))
        return shape_checked(self, obj, *args, **kwargs)

    return _create_tokenized_object


def _flat_ids(tokens):
    for t in tokens or ():
        if isinstance(t, list):
            yield from t
        else:
            yield t


def _patch_detokenize(serving: ModuleType) -> None:
    def make(original):
        def _validate_request(self, request):
            vocab_size = getattr(getattr(self.tokenizer_manager, "model_config", None), "vocab_size", None)
            ids = [t for t in _flat_ids(getattr(request, "tokens", None)) if isinstance(t, int)]
            if vocab_size and ids:
                try:
                    check_token_ids(ids, vocab_size, "token id")
                except ValueError as e:
                    return str(e)
            return original(self, request)

        return _validate_request

    wrap(serving.OpenAIServingDetokenize, "_validate_request", make)


def _shape_errors_are_client_errors(original, errors=(IndexError, TypeError, KeyError, AttributeError)):
    def wrapper(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        except errors as e:
            raise ValueError(f"malformed request: {type(e).__name__}: {e}") from e

    return wrapper


def _patch_io_struct(io: ModuleType) -> None:
    # io_struct also checks request shapes with `assert` ("The rid should be a list.")
    shape = (IndexError, TypeError, KeyError, AttributeError, AssertionError)
    for cls in (io.GenerateReqInput, io.EmbeddingReqInput):
        wrap(cls, "normalize_batch_and_arguments", lambda original: _shape_errors_are_client_errors(original, shape))


def load_format_refusal(load_format: Any) -> str | None:
    """Why /update_weights_from_disk cannot take `load_format` (None: SGLang's LoadFormat knows it)."""
    if load_format is None:
        return None
    from sglang.srt.configs.load_config import LoadFormat

    known = [f.value for f in LoadFormat]
    if isinstance(load_format, LoadFormat) or load_format in known:
        return None
    return f"load_format: not a load format SGLang knows (one of {', '.join(known)})"


def _patch_weight_updater(wu: ModuleType) -> None:
    def make(original):
        def update_weights_from_disk(self, recv_req):
            why = load_format_refusal(getattr(recv_req, "load_format", None))
            if why is not None:
                from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqOutput

                return UpdateWeightFromDiskReqOutput(success=False, message=why, num_paused_requests=0)
            return original(self, recv_req)

        return update_weights_from_disk

    wrap(wu.SchedulerWeightUpdaterManager, "update_weights_from_disk", make)


def install() -> None:
    when_imported("sglang.srt.managers.scheduler_components.weight_updater", _patch_weight_updater)
    when_imported("sglang.srt.managers.tokenizer_manager", _patch_tokenizer_manager)
    when_imported("sglang.srt.entrypoints.openai.serving_tokenize", _patch_detokenize)
    when_imported("sglang.srt.managers.io_struct", _patch_io_struct)
