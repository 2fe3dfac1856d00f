"""Registration of the DFLASH_ADAPTIVE speculative algorithm from the plugin (no SGLang fork).

SGLang dispatches on an algorithm's `is_*()` / `supports_*()` answers. `CustomSpecAlgo` answers
False to all of them and lacks several methods the scheduler calls on every algorithm, so a plain
plugin algorithm would neither capture target hidden states nor build DFlash's future map, and
crashes the scheduler (`create_future_map`, `carries_draft_hidden_states`). `DFlashAdaptiveSpec`
therefore answers every predicate exactly as builtin DFLASH does, and borrows the enum's own
implementation of the structural methods CustomSpecAlgo lacks or stubs -- derived from the enum at
registration time, so a predicate added upstream is covered without a second list.

Server arguments: upstream `_handle_dflash` (steps = 1, topk = 1, block size from the draft
config, draft window, draft attention backend, max running requests); on device cpu through the
CPU layer's platform view, since the builtin refuses CPU.
"""
from __future__ import annotations

import logging
from types import ModuleType

from sglang_ext.names import ALGORITHM
from sglang_ext.patches.wrap import when_imported

logger = logging.getLogger(__name__)
_STRUCTURAL = ("create_future_map", "carries_draft_hidden_states", "need_topk", "get_platform_worker_cls",
               "build_disagg_draft_input")
_OWN = {"is_some", "is_none", "is_speculative"}


def _make_spec_class(spec_info: ModuleType):
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    dflash = spec_info.SpeculativeAlgorithm.DFLASH
    enum_cls = spec_info.SpeculativeAlgorithm
    namespace: dict = {"__doc__": "Answers as builtin DFLASH; see sglang_ext/spec_algo.py."}
    for name, member in vars(enum_cls).items():
        if name.startswith(("is_", "supports_")) and callable(member) and name not in _OWN:
            namespace[name] = (lambda n: lambda self, *a, **k: getattr(dflash, n)(*a, **k))(name)
    for name in _STRUCTURAL:  # missing from CustomSpecAlgo, or (build_disagg_draft_input) a stub returning None there
        if name in vars(enum_cls):
            namespace[name] = vars(enum_cls)[name]  # plain function: runs with our self, which answers as DFLASH

    def handle_server_args(self, server_args) -> None:
        from sglang.srt.arg_groups import speculative_hook

        from sglang_ext.patches.cpu_layer import handle_dflash_on_cpu

        if getattr(server_args, "device", None) == "cpu":
            handle_dflash_on_cpu(server_args)
        else:
            getattr(speculative_hook._handle_dflash, "__wrapped__", speculative_hook._handle_dflash)(server_args)

    namespace["handle_server_args"] = handle_server_args
    return type("DFlashAdaptiveSpec", (CustomSpecAlgo,), namespace)


def _worker_factory(server_args):
    from sglang_ext.worker import AdaptiveDFlashWorker

    return AdaptiveDFlashWorker


def install() -> None:
    def register(spec_info: ModuleType) -> None:
        from sglang.srt.speculative import spec_registry

        if ALGORITHM in getattr(spec_registry, "_REGISTRY", {}):
            return
        spec_info.SpeculativeAlgorithm.register(ALGORITHM, supports_overlap=True,
                                                spec_class=_make_spec_class(spec_info))(_worker_factory)

    when_imported("sglang.srt.speculative.spec_info", register)
