"""SGLang sites that compare the speculative algorithm with DFLASH by name or enum, audited for DFLASH_ADAPTIVE.

DFLASH_ADAPTIVE answers every is_*/supports_* predicate as builtin DFLASH (test_spec_algo.py), but a few
SGLang 0.5.23 sites compare the algorithm's *name* ("DFLASH") or the enum member itself, and those see a
different algorithm. Each parameter below is one such site with its verdict:
  (a) harmless: the difference is confined to a feature, model family or hardware dflash-serve does not
      use, fails closed at start-up, or has no observable effect;
  (b) a difference that matters when serving a plain DFlash drafter with a dense Qwen3 target.
Each test (1) pins the comparison to the installed SGLang (the expression must still be in
`inspect.getsource` of the function: an upgrade that changes it fails here and forces a re-audit), and
(2) where feasible runs the function with DFLASH and DFLASH_ADAPTIVE and checks the claimed behaviour.
`test_every_comparison_is_audited` scans the whole sglang/srt tree so a *new* comparison fails too.

SGLang imports on this machine only with DFLASH_SERVE_CPU=1 set before the interpreter starts, so one
subprocess (about 15 s) gathers every site's facts; the tests read its JSON.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import REPO

A, D = "DFLASH_ADAPTIVE", "DFLASH"
SET = "<set>"  # gate value: any non-None value


def same(value):
    return {D: value, A: value}


@dataclass(frozen=True)
class Site:
    why: str
    verdict: str  # "a" or "b"
    pins: tuple  # (module, qualname or None for the module, expression); whitespace-insensitive substring
    scan: tuple = ()  # keys test_every_comparison_is_audited finds for this site ("path:qualname")
    expect: dict = field(default_factory=dict)  # fact -> exact value the probe must report
    gates: dict = field(default_factory=dict)  # server arg -> value in every shipped config (as dflash_adaptive)


M = "sglang.srt."
SH, KH = M + "arg_groups.speculative_hook", M + "arg_groups.kv_cache_hook"
CPT = M + "arg_groups.cp_tp_group_sharing_hook"

SITES = {
    "spec_utils.py:spec_need_hidden_states": Site(
        "(a) ADAPTIVE makes FutureMap relay draft hidden states, but DFlash's payload is (bs, 0): a 0-byte buffer, "
        "identical resolved draft inputs",
        "a",
        ((M + "speculative.spec_utils", "spec_need_hidden_states",
          'spec.speculative_algorithm in ("STANDALONE", "DFLASH", "DSPARK")'),
         (M + "managers.overlap_utils", "FutureMap._maybe_init_forward_bufs", "and spec_need_hidden_states()"),
         (M + "speculative.draft_worker_common", "make_draft_input_v2",
          "hidden_states=torch.empty((bs, 0), device=device, dtype=torch.float16)")),
        ("speculative/spec_utils.py:spec_need_hidden_states",),
        {"need_hidden_states": {D: False, A: True}, "relay_buffer_numel": {D: None, A: 0},
         "resolved_draft_input": same([[2, 0], "torch.float16", [3, 4]]),
         "adaptive_worker_inherits_next_draft_input": True},
    ),
    "speculative_hook.py:handle_speculative_decoding[decode-radix-cache]": Site(
        "(a) DFLASH is not in the allow-list either: both are refused with PD-decode radix cache, same message",
        "a",
        ((SH, "handle_speculative_decoding",
          'cfg.speculative_algorithm not in (None, "DSPARK", "EAGLE", "EAGLE3")'),),
        (),
        {"plain": same("ok"), "decode_radix_cache": same("ValueError")},
        {"disaggregation_mode": "null"},
    ),
    "speculative_hook.py:handle_speculative_decoding[block-verification]": Site(
        "(a) ADAPTIVE is refused at start-up (SGLang allows it for EAGLE/EAGLE3/DFLASH/DSPARK only): block "
        "verification only changes how a draft with its own q is accepted, a DFlash2 path ADAPTIVE verifies by "
        "token-level rejection sampling (exact without it), and the LiLiCorr heads it would matter for more are "
        "refused by the worker",
        "a",
        ((SH, "handle_speculative_decoding",
          'cfg.speculative_algorithm not in ("EAGLE", "EAGLE3", "DFLASH", "DSPARK")'),
         (M + "speculative.dflash_worker_v2", "DFlashWorkerV2.__init__",
          "self.selector is None and not self._lilicorr_sampling_enabled")),
        ("arg_groups/speculative_hook.py:handle_speculative_decoding",),
        {"block_verification": {D: "ok", A: "ValueError"}, "adaptive_worker_refuses_lilicorr_heads": "ValueError"},
        {"speculative_use_block_verification": False},
    ),
    "speculative_hook.py:handle_speculative_decoding[draft-window-warning]": Site(
        "(a) ADAPTIVE only logs a wrong 'has no effect' warning; the worker then refuses a draft window anyway",
        "a",
        ((SH, "handle_speculative_decoding", 'cfg.speculative_algorithm not in ("EAGLE", "EAGLE3", "DFLASH")'),),
        ("arg_groups/speculative_hook.py:handle_speculative_decoding",),
        {"window_outcome": same("ok"), "warns_no_effect": {D: False, A: True},
         "adaptive_worker_refuses_window": "ValueError"},
        {"speculative_draft_window_size": None},
    ),
    "validation_hook.py:handle_aux_hidden_state_capture": Site(
        "(a) capture-only mode (no draft model): dflash-serve always passes a drafter, which both algorithms refuse",
        "a",
        ((M + "arg_groups.validation_hook", None, '_AUX_HIDDEN_STATE_CAPTURE_METHODS = ("EAGLE3", "DFLASH", "DSPARK")'),
         (M + "arg_groups.validation_hook", "handle_aux_hidden_state_capture",
          "method not in _AUX_HIDDEN_STATE_CAPTURE_METHODS")),
        ("arg_groups/validation_hook.py:_AUX_HIDDEN_STATE_CAPTURE_METHODS",),
        {"flag_with_drafter": same("ValueError"), "flag_off": same("ok")},
        {"enable_return_aux_hidden_states": False, "speculative_draft_model_path": SET},
    ),
    "model_override_base.py:_forces_eagle_topk_one": Site(
        "(b) on SM100/SM103 with no --attention-backend, the dense target defaults to trtllm_mha under DFLASH but "
        "flashinfer under ADAPTIVE (Hopper and CPU unaffected)",
        "b",
        ((M + "arg_groups.model_override_base", "_forces_eagle_topk_one",
          "str(speculative_algorithm).upper() == SpeculativeAlgorithm.DFLASH.name"),
         (M + "arg_groups.model_override_base", "get_default_attn_backend",
          "or _forces_eagle_topk_one(cfg.speculative_algorithm)")),
        ("arg_groups/model_override_base.py:_forces_eagle_topk_one",),
        {"upstream_forces_topk_one": {D: True, A: False},
         "upstream_default_backend": {"sm100": {D: "trtllm_mha", A: "flashinfer"}, "hopper": same("fa3"),
                                      "other_cuda": same("flashinfer")}},
    ),
    "kv_cache_hook.py:handle_kv4_compatibility": Site(
        "(a) NVFP4 KV on SM100 only; the DFLASH-specific refusal is skipped but the generic allow-list refuses "
        "ADAPTIVE too",
        "a",
        ((KH, "handle_kv4_compatibility", 'uses_sm100_trtllm_nvfp4 and speculative_algorithm in ("DFLASH", "DSPARK",)'),
         (KH, "handle_kv4_compatibility", "speculative_algorithm not in supported_native_spec_algorithms")),
        ("arg_groups/kv_cache_hook.py:handle_kv4_compatibility",),
        {"nvfp4_sm100": same("ValueError"), "adaptive_refused_by_generic_allow_list": True,
         "kv_cache_dtype_auto": same("ok")},
        {"kv_cache_dtype": "auto"},
    ),
    "kv_cache_hook.py:handle_unified_memory_pool[algorithm-allow-list]": Site(
        "(a) --enable-unified-memory only (off in dflash-serve); ADAPTIVE fails closed with an AssertionError",
        "a",
        ((KH, "handle_unified_memory_pool",
          'assert cfg.speculative_algorithm in (None, "DSPARK", "EAGLE", "EAGLE3", "DFLASH",)'),),
        ("arg_groups/kv_cache_hook.py:handle_unified_memory_pool",),
        {"enabled": {D: "ok", A: "AssertionError"}, "disabled": same("ok")},
        {"enable_unified_memory": False},
    ),
    "kv_cache_hook.py:handle_unified_memory_pool[dflash-verify-backends]": Site(
        "(a) unreachable for ADAPTIVE: the allow-list assert above refuses it first (unified memory is off anyway)",
        "a",
        ((KH, "handle_unified_memory_pool", 'if cfg.speculative_algorithm == "DFLASH":'),),
        ("arg_groups/kv_cache_hook.py:handle_unified_memory_pool",),
        {"backend_check_runs_for": {D: ["DFLASH"], A: []}},
        {"enable_unified_memory": False},
    ),
    "attention_hook.py:handle_linear_attn_backend": Site(
        "(a) ReplaySSM spec verify of linear-attention (KDA) targets only; dense Qwen3 has none and ADAPTIVE fails "
        "closed",
        "a",
        ((M + "arg_groups.attention_hook", "handle_linear_attn_backend",
          '_algo not in ("DSPARK", "DFLASH") or verify not in ("triton", "nv_cutedsl",)'),),
        ("arg_groups/attention_hook.py:handle_linear_attn_backend",),
        {"compact_ragged": {D: "ok", A: "ValueError"}, "static_ragged": same("ok"), "flag_off": same("ok"),
         "qwen3_is_linear_attention": False},
        {"enable_linear_replayssm_spec": False},
    ),
    "kv_cache_configurator.py:KVCacheConfigurator._build_hybrid_req_pool": Site(
        "(a) hybrid (mamba/linear-attention) targets only: a dense Qwen3 never builds this pool, and the ADAPTIVE "
        "worker refuses mamba targets",
        "a",
        ((M + "mem_cache.kv_cache_configurator", "KVCacheConfigurator._build_hybrid_req_pool",
          '_algo in ("DSPARK", "DFLASH")'),
         (M + "mem_cache.kv_cache_configurator", "KVCacheConfigurator._build_req_to_token_pool",
          "if self.mambaish_config: return self._build_hybrid_req_pool(")),
        ("mem_cache/kv_cache_configurator.py:KVCacheConfigurator._build_hybrid_req_pool",),
        {"kda_guard": {D: "refused", A: "passed"}, "qwen3_is_mambaish": False,
         "adaptive_worker_refuses_mamba": True},
        {"enable_linear_replayssm_spec": False},
    ),
    "lora_hook.py:check_lora_speculative_compatibility": Site(
        "(a) LoRA only (unused); ADAPTIVE is refused at start-up, rightly: its per-width verify graphs would not "
        "rebuild LoRA metadata (why upstream refuses --speculative-adaptive)",
        "a",
        ((M + "arg_groups.lora_hook", "check_lora_speculative_compatibility",
          'lora_spec_algorithms = ("EAGLE", "EAGLE3", "DFLASH", "DSPARK")'),
         (M + "arg_groups.lora_hook", "check_lora_speculative_compatibility",
          "if cfg.speculative_algorithm not in lora_spec_algorithms:")),
        ("arg_groups/lora_hook.py:check_lora_speculative_compatibility",),
        {"lora_enabled": {D: "ok", A: "ValueError"}},
        {"enable_lora": None, "lora_paths": None},
    ),
    "cp_tp_group_sharing_hook.py:resolve_cp_tp_group_sharing[speculative]": Site(
        "(a) prefill CP-TP group sharing exists for GLM-5.3-Flash / Qwen4-Exp only; a Qwen3 target returns early",
        "a",
        ((CPT, "resolve_cp_tp_group_sharing", 'if cfg.speculative_algorithm != "DFLASH" and ('),),
        ("arg_groups/cp_tp_group_sharing_hook.py:resolve_cp_tp_group_sharing",),
        {"qwen3_with_prefill_cp": same("ok"), "qwen3_supported": False},
        {"enable_prefill_cp": False},
    ),
    "cp_tp_group_sharing_hook.py:resolve_cp_tp_group_sharing[pd-disaggregation]": Site(
        "(a) GLM-5.3-Flash PD disaggregation with CP-TP sharing only; Qwen3 never reaches it",
        "a",
        ((CPT, "resolve_cp_tp_group_sharing",
          '"speculative-algorithm != DFLASH": cfg.speculative_algorithm != "DFLASH",'),),
        ("arg_groups/cp_tp_group_sharing_hook.py:resolve_cp_tp_group_sharing",),
        {"qwen3_with_prefill_cp": same("ok"), "qwen3_supported": False},
        {"enable_prefill_cp": False, "disaggregation_mode": "null"},
    ),
    "minimax_m3.py:_minimax_m3_overrides": Site(
        "(a) a MiniMax-M3 NVFP4 model override: never called for a Qwen3 target",
        "a",
        ((M + "arg_groups.model_overrides.minimax_m3", "_minimax_m3_overrides",
          'if cfg.speculative_algorithm not in (None, "DSPARK", "DFLASH"):'),
         (M + "arg_groups.model_overrides.minimax_m3", "_minimax_m3_overrides",
          'if cfg.speculative_algorithm in ("DSPARK", "DFLASH"):'),
         (M + "arg_groups.model_overrides.minimax_m3", "_minimax_m3_overrides",
          'if algorithm == "DFLASH" and cfg.disaggregation_mode != "null":')),
        ("arg_groups/model_overrides/minimax_m3.py:_minimax_m3_overrides",),
        {"registered_for": ["MiniMaxM3SparseForCausalLM", "MiniMaxM3SparseForConditionalGeneration"],
         "qwen3_providers": []},
    ),
    "nemotron_h.py:_nemotron_h_overrides": Site(
        "(a) a Nemotron-H model override (Blackwell draft backend default): never called for a Qwen3 target",
        "a",
        ((M + "arg_groups.model_overrides.nemotron_h", "_nemotron_h_overrides",
          'and speculative_algorithm in ("EAGLE", "NEXTN", "DFLASH", "DSPARK")'),),
        ("arg_groups/model_overrides/nemotron_h.py:_nemotron_h_overrides",),
        {"registered_for": ["NemotronHForCausalLM", "NemotronHPuzzleForCausalLM", "NemotronH_Omni_Reasoning_V3"],
         "qwen3_providers": []},
    ),
    "layernorm_sp_hook.py:validate_layernorm_sp": Site(
        "(a) --enable-layernorm-sp allows speculation only for Muse Spark DFLASH: a Qwen3 target is refused with "
        "either algorithm",
        "a",
        ((M + "arg_groups.layernorm_sp_hook", "validate_layernorm_sp",
          'is_muse_spark_architecture(architecture) and speculative_algorithm == "DFLASH"'),),
        ("arg_groups/layernorm_sp_hook.py:validate_layernorm_sp",),
        {"qwen3_with_speculation": same("ValueError")},
        {"enable_layernorm_sp": False},
    ),
    "mooncake/conn.py:MooncakeKVManager._validate_peer_state_layout": Site(
        "(a) PD disaggregation over Mooncake with CP-TP sharing (linear-attention TP != attention TP) only; "
        "dflash-serve serves colocated",
        "a",
        ((M + "disaggregation.mooncake.conn", "MooncakeKVManager._validate_peer_state_layout",
          'get_spec().speculative_algorithm == "DFLASH"'),),
        ("disaggregation/mooncake/conn.py:MooncakeKVManager._validate_peer_state_layout",),
        {"same_tp": same([True, None]), "cp_tp_sharing_mismatch_accepted": {D: False, A: True}},
        {"disaggregation_mode": "null"},
    ),
    "metrics_reporter.py:SchedulerMetricsReporter.snapshot_spec_decode_metrics": Site(
        "(b, only with --enable-forward-pass-metrics) ADAPTIVE batches get no pre-settle decode-KV snapshot; FPM "
        "falls back to the post-step batch. Off in dflash-serve",
        "b",
        ((M + "managers.scheduler_components.metrics_reporter", None,
          "_SPEC_DECODE_SNAPSHOT_ALGORITHMS = (SpeculativeAlgorithm.EAGLE, SpeculativeAlgorithm.EAGLE3, "
          "SpeculativeAlgorithm.DFLASH, SpeculativeAlgorithm.DSPARK,)"),
         (M + "managers.scheduler_components.metrics_reporter",
          "SchedulerMetricsReporter.snapshot_spec_decode_metrics",
          "if batch.spec_algorithm not in _SPEC_DECODE_SNAPSHOT_ALGORITHMS:")),
        ("managers/scheduler_components/metrics_reporter.py:_SPEC_DECODE_SNAPSHOT_ALGORITHMS",),
        {"upstream_snapshot": {D: True, A: False}},
        {"enable_forward_pass_metrics": False},
    ),
    "adaptive_spec_params.py:adaptive_unsupported_reason": Site(
        "(a) upstream --speculative-adaptive is EAGLE-only: DFLASH is refused the same way (dflash-serve never sets it)",
        "a",
        ((M + "speculative.adaptive_spec_params", "adaptive_unsupported_reason",
          'if cfg.speculative_algorithm not in ("EAGLE", "EAGLE3"):'),),
        (),
        {"reason_given": same(True)},
        {"speculative_adaptive": False},
    ),
    "dflash_worker_v2.py:DFlashWorkerV2.forward_batch_generation[draft-batch-stamp]": Site(
        "(a) not a comparison: the draft forward is stamped with the DFLASH enum, as in the adaptive worker's steps/draft.py, "
        "so draft-side code sees builtin DFLASH",
        "a",
        ((M + "speculative.dflash_worker_v2", "DFlashWorkerV2.forward_batch_generation",
          "spec_algorithm=SpeculativeAlgorithm.DFLASH,"),),
        (),
        {"adaptive_worker_stamps_dflash": True},
    ),
}

# Comparisons inside the enum's own methods: DFlashAdaptiveSpec overrides every one (tests/unit/test_spec_algo.py).
EXEMPT = {
    "speculative/spec_info.py:SpeculativeAlgorithm.is_dflash",
    "speculative/spec_info.py:SpeculativeAlgorithm.supports_mixed_chunk",
}

PROBE = r'''
import contextlib, inspect, importlib, json, logging, re, sys, types
from pathlib import Path

import msgspec, torch, yaml

import sglang_ext.plugin as plugin
plugin.register()
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm as S
from sglang.srt.server_args import ServerArgs

SITES, GATE_FIELDS, REPO = json.loads(sys.argv[1]), json.loads(sys.argv[2]), Path(sys.argv[3])
ALGOS = {"DFLASH": S.DFLASH, "DFLASH_ADAPTIVE": S.from_string("DFLASH_ADAPTIVE")}
DEFAULTS = {}
for f in msgspec.structs.fields(ServerArgs):
    if f.default is not msgspec.NODEFAULT:
        DEFAULTS[f.name] = f.default
    elif f.default_factory is not msgspec.NODEFAULT:
        DEFAULTS[f.name] = f.default_factory()


def args(**kw):
    return types.SimpleNamespace(**(DEFAULTS | kw))


def outcome(fn, *a, **k):
    try:
        fn(*a, **k)
        return "ok"
    except Exception as e:
        return type(e).__name__


def both(fn):
    return {name: fn(name) for name in ALGOS}


@contextlib.contextmanager
def patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def squash(text):
    return re.sub(r"\s+", "", text)


def resolve(module, qualname):
    obj = importlib.import_module(module)
    for part in (qualname.split(".") if qualname else ()):
        obj = getattr(obj, part)
    return inspect.unwrap(obj)  # a dflash-serve patch wraps with __wrapped__: pin upstream's source


def fake_worker(**kw):
    return types.SimpleNamespace(**({"selector": None, "lilicorr": None, "_is_domino": False,
                                     "draft_window_size": None} | kw))


DEMOS = {}


def demo(site_id):
    def register(fn):
        DEMOS[site_id] = fn
        return fn
    return register


@demo("spec_utils.py:spec_need_hidden_states")
def _():
    from sglang.srt.managers import overlap_utils as ou
    from sglang.srt.speculative import spec_utils
    from sglang.srt.speculative.dflash_worker_v2 import DFlashWorkerV2
    from sglang_ext.worker import AdaptiveDFlashWorker

    def run(name):
        spec = types.SimpleNamespace(speculative_algorithm=name, enable_multi_layer_eagle=False)
        with patched(spec_utils, "get_spec", lambda: spec):
            need = spec_utils.spec_need_hidden_states()
            pool = types.SimpleNamespace(req_to_token=torch.zeros(8, 4, dtype=torch.int32))
            fm = ALGOS[name].create_future_map(torch.device("cpu"), pool, needs_cpu_seq_lens=False)
            idx = torch.tensor([1, 2])
            # what the worker publishes after a decode step, then what the next step resolves
            out = DFlashWorkerV2._make_next_draft_input_decode(None, bonus_tokens=torch.tensor([3, 4]),
                                                               new_seq_lens=torch.tensor([5, 6]))
            fm.stash(idx, ou.RelayPayload.from_draft_input(out))
            nxt = DFlashWorkerV2._make_next_draft_input_prefill(None, bonus_tokens=torch.zeros(2, dtype=torch.int64),
                                                                seq_lens=torch.tensor([5, 6]))
            nxt.future_indices = idx
            fm._resolve_spec_extras(types.SimpleNamespace(spec_info=nxt))
        buf = fm.hidden_states_buf
        return need, None if buf is None else buf.numel(), [list(nxt.hidden_states.shape),
                                                             str(nxt.hidden_states.dtype), nxt.bonus_tokens.tolist()]

    r = both(run)
    return {"need_hidden_states": {n: v[0] for n, v in r.items()}, "relay_buffer_numel": {n: v[1] for n, v in r.items()},
            "resolved_draft_input": {n: v[2] for n, v in r.items()},
            "adaptive_worker_inherits_next_draft_input":
                AdaptiveDFlashWorker._make_next_draft_input_decode is DFlashWorkerV2._make_next_draft_input_decode}


def speculative_hook(name, **kw):
    from sglang.srt.arg_groups import speculative_hook as sh
    with patched(sh, "_handle_dflash", lambda server_args: None):  # its model/device checks are not the point
        return outcome(sh.handle_speculative_decoding, args(speculative_algorithm=name, device="cuda", **kw))


@demo("speculative_hook.py:handle_speculative_decoding[decode-radix-cache]")
def _():
    return {"plain": both(speculative_hook),
            "decode_radix_cache": both(lambda n: speculative_hook(n, disaggregation_mode="decode",
                                                                  disaggregation_decode_enable_radix_cache=True))}


@demo("speculative_hook.py:handle_speculative_decoding[block-verification]")
def _():
    from sglang_ext.worker import AdaptiveDFlashWorker
    return {"block_verification": both(lambda n: speculative_hook(n, speculative_use_block_verification=True)),
            "adaptive_worker_refuses_lilicorr_heads":
                outcome(AdaptiveDFlashWorker._refuse_unsupported, fake_worker(lilicorr=object()))}


@demo("speculative_hook.py:handle_speculative_decoding[draft-window-warning]")
def _():
    from sglang.srt.arg_groups import speculative_hook as sh
    from sglang_ext.worker import AdaptiveDFlashWorker

    class Capture(logging.Handler):
        def __init__(self):
            super().__init__()
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    outcomes, warned = {}, {}
    for name in ALGOS:
        h = Capture()
        sh.logger.addHandler(h)
        try:
            outcomes[name] = speculative_hook(name, speculative_draft_window_size=64)
        finally:
            sh.logger.removeHandler(h)
        warned[name] = any("has no effect" in m for m in h.messages)
    return {"window_outcome": outcomes, "warns_no_effect": warned,
            "adaptive_worker_refuses_window":
                outcome(AdaptiveDFlashWorker._refuse_unsupported, fake_worker(draft_window_size=64))}


@demo("validation_hook.py:handle_aux_hidden_state_capture")
def _():
    from sglang.srt.arg_groups import validation_hook as vh
    return {"flag_with_drafter": both(lambda n: outcome(vh.handle_aux_hidden_state_capture, args(
                speculative_algorithm=n, enable_return_aux_hidden_states=True, speculative_draft_model_path="/d"))),
            "flag_off": both(lambda n: outcome(vh.handle_aux_hidden_state_capture, args(
                speculative_algorithm=n, speculative_draft_model_path="/d")))}


@demo("model_override_base.py:_forces_eagle_topk_one")
def _():
    from sglang.srt.arg_groups import model_override_base as mob
    current, upstream = mob._forces_eagle_topk_one, inspect.unwrap(mob._forces_eagle_topk_one)
    qwen3 = types.SimpleNamespace(hf_config=types.SimpleNamespace(architectures=["Qwen3ForCausalLM"]),
                                  has_asymmetric_kv=False, has_attention_sinks=False)
    gpus = {"sm100": dict(is_sm100=True), "hopper": dict(is_hopper_with_cuda_12_3=True), "other_cuda": {}}

    def backends(fn):
        out = {}
        for gpu, flags in gpus.items():
            plat = types.SimpleNamespace(**({"is_hopper_with_cuda_12_3": False, "is_sm100": False, "is_hip": False,
                                             "has_flashinfer": True} | flags))
            with patched(mob, "get_platform", lambda: plat), \
                    patched(mob, "current_platform", types.SimpleNamespace(is_out_of_tree=lambda: False)), \
                    patched(mob, "_forces_eagle_topk_one", fn):
                # speculative_eagle_topk is still None here: _handle_dflash sets it later
                out[gpu] = both(lambda n: mob.get_default_attn_backend(args(speculative_algorithm=n), False, qwen3))
        return out

    return {"upstream_forces_topk_one": both(upstream), "upstream_default_backend": backends(upstream),
            "patched": current is not upstream, "effective_default_backend": backends(current)}


@demo("kv_cache_hook.py:handle_kv4_compatibility")
def _():
    from sglang.srt.arg_groups import kv_cache_hook as kh
    plat = types.SimpleNamespace(is_cuda=True, is_sm100=True, is_sm120=False, is_blackwell=True)
    messages = {}

    def run(name, **kw):
        try:
            kh.handle_kv4_compatibility(args(speculative_algorithm=name, **kw))
            return "ok"
        except Exception as e:
            messages[name] = str(e)
            return type(e).__name__

    with patched(kh, "get_platform", lambda: plat), patched(kh, "use_mla_backend", lambda server_args: False):
        nvfp4 = both(lambda n: run(n, kv_cache_dtype="nvfp4", attention_backend="trtllm_mha"))
        generic = "supports EAGLE, EAGLE3, NEXTN" in messages.get("DFLASH_ADAPTIVE", "")
        auto = both(lambda n: run(n, attention_backend="trtllm_mha"))
    return {"nvfp4_sm100": nvfp4, "adaptive_refused_by_generic_allow_list": generic, "kv_cache_dtype_auto": auto}


def unified(name, **kw):
    from sglang.srt.arg_groups import kv_cache_hook as kh
    seen = []
    with patched(kh, "_assert_spec_verify_backends", lambda server_args, **k: seen.append(k["algorithm"])):
        return outcome(kh.handle_unified_memory_pool, args(speculative_algorithm=name, **kw)), seen


@demo("kv_cache_hook.py:handle_unified_memory_pool[algorithm-allow-list]")
def _():
    return {"enabled": both(lambda n: unified(n, enable_unified_memory=True)[0]),
            "disabled": both(lambda n: unified(n)[0])}


@demo("kv_cache_hook.py:handle_unified_memory_pool[dflash-verify-backends]")
def _():
    return {"backend_check_runs_for": both(lambda n: unified(n, enable_unified_memory=True)[1])}


def qwen3_model_config():
    from transformers import Qwen3Config
    from sglang.srt.configs.linear_attn_model_registry import get_linear_attn_config
    hf = Qwen3Config(architectures=["Qwen3ForCausalLM"])
    return types.SimpleNamespace(hf_config=hf, is_draft_model=False, linear_attn_registry_result=get_linear_attn_config(hf))


@demo("attention_hook.py:handle_linear_attn_backend")
def _():
    import os
    from sglang.srt.arg_groups import attention_hook as ah
    from sglang.srt.configs.hybrid_arch import mambaish_config

    def run(name, mode, **kw):
        old = os.environ.get("SGLANG_RAGGED_VERIFY_MODE")
        os.environ["SGLANG_RAGGED_VERIFY_MODE"] = mode
        try:
            return outcome(ah.handle_linear_attn_backend, args(speculative_algorithm=name, **kw))
        finally:
            os.environ.pop("SGLANG_RAGGED_VERIFY_MODE") if old is None else os.environ.update(SGLANG_RAGGED_VERIFY_MODE=old)

    spec = dict(enable_linear_replayssm_spec=True, linear_attn_decode_backend="triton",
                linear_attn_verify_backend="triton", mamba_ssm_dtype="float32")
    return {"compact_ragged": both(lambda n: run(n, "compact", **spec)),
            "static_ragged": both(lambda n: run(n, "static", **spec)),
            "flag_off": both(lambda n: run(n, "compact")),
            "qwen3_is_linear_attention": mambaish_config(qwen3_model_config()) is not None}


@demo("kv_cache_configurator.py:KVCacheConfigurator._build_hybrid_req_pool")
def _():
    from unittest import mock
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.mem_cache import kv_cache_configurator as kcc
    from sglang_ext.worker import AdaptiveDFlashWorker

    class PastTheGuard(Exception):
        """Raised by the pool constructor, the first call after the guard: the guard let the algorithm through."""

    def pool(**_):
        raise PastTheGuard

    def run(name):
        exec_bag = mock.MagicMock()
        exec_bag.mamba.enable_linear_replayssm_spec = True
        spec = types.SimpleNamespace(speculative_algorithm=name, speculative_eagle_topk=None)
        bag = mock.MagicMock()  # the other config namespaces the pool's arguments read
        with patched(kcc, "get_spec", lambda: spec), patched(kcc, "get_exec", lambda: exec_bag), \
                patched(kcc, "get_schedule", lambda: bag), patched(kcc, "get_memory", lambda: bag), \
                patched(kcc, "_pd_prefill_skips_mamba_spec_state", lambda: True), \
                patched(kcc, "HybridReqToTokenPool", pool):
            try:
                kcc.KVCacheConfigurator._build_hybrid_req_pool(mock.MagicMock(hybrid_kda_config=None),
                                                               max_num_reqs=4, extra_max_context_len=0)
            except PastTheGuard:
                return "passed"
            except ValueError as e:
                if "requires a KDA" in str(e):
                    return "refused"
                raise
        raise AssertionError("_build_hybrid_req_pool neither refused nor reached the pool constructor")

    return {"kda_guard": both(run), "qwen3_is_mambaish": mambaish_config(qwen3_model_config()) is not None,
            "adaptive_worker_refuses_mamba":
                "self._need_mamba_verify_commit" in inspect.getsource(AdaptiveDFlashWorker.init_attention_backends)}


@demo("lora_hook.py:check_lora_speculative_compatibility")
def _():
    from sglang.srt.arg_groups import lora_hook as lh
    return {"lora_enabled": both(lambda n: outcome(lh.check_lora_speculative_compatibility,
                                                   args(speculative_algorithm=n)))}


def cp_tp():
    from sglang.srt.arg_groups import cp_tp_group_sharing_hook as cph
    qwen3 = types.SimpleNamespace(hf_config=types.SimpleNamespace(architectures=["Qwen3ForCausalLM"]))
    return {"qwen3_with_prefill_cp": both(lambda n: outcome(cph.resolve_cp_tp_group_sharing, args(
                speculative_algorithm=n, enable_prefill_cp=True, attn_cp_size=2, tp_size=2), qwen3)),
            "qwen3_supported": "Qwen3ForCausalLM" in cph._SUPPORTED_MODELS}


DEMOS["cp_tp_group_sharing_hook.py:resolve_cp_tp_group_sharing[speculative]"] = cp_tp
DEMOS["cp_tp_group_sharing_hook.py:resolve_cp_tp_group_sharing[pd-disaggregation]"] = cp_tp


def model_override(fn):
    import sglang.srt.arg_groups.model_overrides  # noqa: F401  (registers every provider)
    from sglang.srt.arg_groups import model_override_base as mob
    qwen3 = list(mob._MODEL_OVERRIDE_FNS.get("Qwen3ForCausalLM", []))
    qwen3 += [f for predicate, f in mob._PREDICATE_OVERRIDE_FNS if predicate("Qwen3ForCausalLM")]
    return {"registered_for": sorted(a for a, fns in mob._MODEL_OVERRIDE_FNS.items() if fn in fns),
            "qwen3_providers": [f.__qualname__ for f in qwen3]}


@demo("minimax_m3.py:_minimax_m3_overrides")
def _():
    from sglang.srt.arg_groups.model_overrides import minimax_m3
    return model_override(minimax_m3._minimax_m3_overrides)


@demo("nemotron_h.py:_nemotron_h_overrides")
def _():
    from sglang.srt.arg_groups.model_overrides import nemotron_h
    return model_override(nemotron_h._nemotron_h_overrides)


@demo("layernorm_sp_hook.py:validate_layernorm_sp")
def _():
    from sglang.srt.arg_groups import layernorm_sp_hook as lsp
    return {"qwen3_with_speculation": both(lambda n: outcome(
        lsp.validate_layernorm_sp, architecture="Qwen3ForCausalLM", tp_size=2, attn_dp_enabled=False,
        speculative_algorithm=n))}


@demo("mooncake/conn.py:MooncakeKVManager._validate_peer_state_layout")
def _():
    from sglang.srt.disaggregation.mooncake import conn

    def run(name, attn_tp_size):
        manager = types.SimpleNamespace(state_tp_size=2, attn_tp_size=attn_tp_size,
                                        kv_args=types.SimpleNamespace(state_types=[]))
        peer = types.SimpleNamespace(dst_attn_tp_size=1, dst_state_data_ptrs=[])
        spec = types.SimpleNamespace(speculative_algorithm=name)
        with patched(conn, "get_spec", lambda: spec):
            return list(conn.MooncakeKVManager._validate_peer_state_layout(manager, peer))

    return {"same_tp": both(lambda n: run(n, 2)),
            "cp_tp_sharing_mismatch_accepted": both(lambda n: run(n, 4)[1] is None)}


@demo("metrics_reporter.py:SchedulerMetricsReporter.snapshot_spec_decode_metrics")
def _():
    from sglang.srt.managers.scheduler_components import metrics_reporter as mr
    adaptive = ALGOS["DFLASH_ADAPTIVE"]

    def snap(name):
        reporter = types.SimpleNamespace(scheduler=types.SimpleNamespace(enable_fpm=True))
        batch = types.SimpleNamespace(spec_algorithm=ALGOS[name], reqs=[types.SimpleNamespace(seqlen=5)])
        result = types.SimpleNamespace()
        mr.SchedulerMetricsReporter.snapshot_spec_decode_metrics(reporter, batch, result)
        return hasattr(result, "fpm_scheduled_requests")

    current = mr._SPEC_DECODE_SNAPSHOT_ALGORITHMS
    with patched(mr, "_SPEC_DECODE_SNAPSHOT_ALGORITHMS", tuple(a for a in current if a is not adaptive)):
        upstream = both(snap)
    return {"upstream_snapshot": upstream, "patched": any(a is adaptive for a in current), "effective_snapshot": both(snap)}


@demo("adaptive_spec_params.py:adaptive_unsupported_reason")
def _():
    from sglang.srt.speculative import adaptive_spec_params as asp
    return {"reason_given": both(lambda n: isinstance(asp.adaptive_unsupported_reason(args(speculative_algorithm=n)), str))}


@demo("dflash_worker_v2.py:DFlashWorkerV2.forward_batch_generation[draft-batch-stamp]")
def _():
    from sglang_ext.steps.draft import draft_forward
    return {"adaptive_worker_stamps_dflash":
                "spec_algorithm=upstream.SpeculativeAlgorithm.DFLASH" in inspect.getsource(draft_forward)}


def shipped_configs():
    from service.config import parse_config
    from service.sglang_args import build_args
    out = {}
    for path in sorted((REPO / "deploy" / "configs").glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        spec = data.setdefault("speculative", {})
        spec["algorithm"] = "dflash_adaptive"
        spec.pop("block_size", None)
        effective = DEFAULTS | build_args(parse_config(data, base=path.parent))
        out[path.name] = {k: (None if effective.get(k) is None else str(effective[k]) if isinstance(effective[k], Path)
                              else effective[k]) for k in GATE_FIELDS}
    return out


report = {"pins": {}, "facts": {}, "errors": {}}
for site_id, pins in SITES.items():
    missing = []
    for module, qualname, expr in pins:
        try:
            src = inspect.getsource(resolve(module, qualname))
        except Exception as e:
            missing.append(f"{module}:{qualname}: {type(e).__name__}: {e}")
            continue
        if squash(expr) not in squash(src):
            missing.append(f"{module}:{qualname}: {expr}")
    report["pins"][site_id] = missing
    try:
        report["facts"][site_id] = DEMOS[site_id]() if site_id in DEMOS else {}
    except Exception:
        import traceback
        report["errors"][site_id] = traceback.format_exc()[-2000:]
report["configs"] = shipped_configs()
print("RESULT" + json.dumps(report))
'''


@pytest.fixture(scope="module")
def probe() -> dict:
    sites = {sid: [list(p) for p in s.pins] for sid, s in SITES.items()}
    gates = sorted({g for s in SITES.values() for g in s.gates})
    env = dict(os.environ, DFLASH_SERVE_CPU="1")
    proc = subprocess.Popen([sys.executable, "-c", PROBE, json.dumps(sites), json.dumps(gates), str(REPO)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        scan = _scan_sglang()  # meanwhile
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    line = next((l for l in stdout.splitlines() if l.startswith("RESULT")), None)
    assert line, stderr[-3000:]
    return json.loads(line[len("RESULT"):]) | {"scan": scan}


@pytest.mark.parametrize("site_id", list(SITES), ids=list(SITES))
def test_site(site_id, probe):
    site = SITES[site_id]
    assert site.verdict in ("a", "b") and site.why.startswith(f"({site.verdict}")
    assert probe["pins"][site_id] == [], "SGLang changed this site: re-audit it for DFLASH_ADAPTIVE"
    assert site_id not in probe["errors"], probe["errors"].get(site_id)
    facts = probe["facts"][site_id]
    for fact, expected in site.expect.items():
        assert facts.get(fact) == expected, f"{fact}: {facts.get(fact)!r} != {expected!r}"
    if site.verdict == "b":  # sglang_ext.spec_algo patches every such site: the patch must be in and close the gap
        assert facts.get("patched"), "no dflash-serve patch installed for a site that behaves differently"
        effective = facts.get("effective_default_backend") or {"-": facts.get("effective_snapshot")}
        for per_algorithm in effective.values():
            assert per_algorithm[A] == per_algorithm[D], effective
    assert probe["configs"], "no shipped configs found"
    for name, values in probe["configs"].items():
        for gate, off in site.gates.items():
            if off == SET:
                assert values[gate] is not None, f"{name}: {gate} unset"
            else:
                assert values[gate] == off, f"{name}: {gate} = {values[gate]!r} turns this site on"


# -- completeness: every name/enum comparison with DFLASH in sglang/srt is one of the sites above ------------------

def _mentions_dflash(node) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value.upper() == "DFLASH"
    if isinstance(node, ast.Attribute):
        return node.attr == "DFLASH" or (node.attr in ("name", "value") and _mentions_dflash(node.value))
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_mentions_dflash(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return any(k is not None and _mentions_dflash(k) for k in node.keys)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("frozenset", "set", "tuple"):
        return any(_mentions_dflash(a) for a in node.args)
    return False


class _Scanner(ast.NodeVisitor):
    """Comparisons (==, !=, in, not in, is) and match/case with "DFLASH" / SpeculativeAlgorithm.DFLASH, and
    module- or class-level collections of them (compared against elsewhere)."""

    def __init__(self, rel: str):
        self.rel, self.scope, self.functions, self.hits = rel, [], 0, set()

    def _key(self, *extra: str) -> str:
        return f"{self.rel}:{'.'.join([*self.scope, *extra]) or '<module>'}"

    def _enter(self, node, is_function: bool):
        self.scope.append(node.name)
        self.functions += is_function
        self.generic_visit(node)
        self.functions -= is_function
        self.scope.pop()

    def visit_FunctionDef(self, node):
        self._enter(node, True)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        self._enter(node, False)

    def visit_Compare(self, node):
        if any(_mentions_dflash(x) for x in (node.left, *node.comparators)):
            self.hits.add(self._key())
        self.generic_visit(node)

    def visit_Assign(self, node):
        # a collection (or the enum member) bound to a name and compared against later; a bare "DFLASH" string
        # bound locally is a label (e.g. _handle_dflash's `algorithm`), not a comparison
        if isinstance(node.value, (ast.Tuple, ast.List, ast.Set, ast.Dict, ast.Call, ast.Attribute)) \
                and _mentions_dflash(node.value):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            self.hits.update([self._key()] if self.functions else [self._key(n) for n in names])
        self.generic_visit(node)

    def visit_match_case(self, node):
        if any(isinstance(p, ast.MatchValue) and _mentions_dflash(p.value) for p in ast.walk(node.pattern)):
            self.hits.add(self._key())
        self.generic_visit(node)


def _scan_sglang() -> set[str]:
    root = Path(importlib.util.find_spec("sglang").submodule_search_locations[0]) / "srt"
    quick = re.compile(r"""['"]dflash['"]|\.DFLASH\b""", re.IGNORECASE)
    found: set[str] = set()
    for path in root.rglob("*.py"):
        text = path.read_text(errors="replace")
        if quick.search(text):
            scanner = _Scanner(path.relative_to(root).as_posix())
            scanner.visit(ast.parse(text))
            found |= scanner.hits
    return found


def test_every_comparison_is_audited(probe):
    found = probe["scan"]
    audited = {key for s in SITES.values() for key in s.scan} | EXEMPT
    assert found - audited == set(), "new DFLASH comparisons in SGLang: audit them for DFLASH_ADAPTIVE"
    assert audited - found == set(), "audited comparisons no longer found: update SITES"
