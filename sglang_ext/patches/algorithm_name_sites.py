"""SGLang call sites that compare the speculative algorithm by name, where DFLASH_ADAPTIVE must answer as DFLASH.

Every such site in SGLang 0.5.23 is audited in tests/unit/test_algorithm_name_sites.py (a tree scan fails on a new
one); these are the ones that are not harmless. They run after the algorithm is registered (plugin.register): in
the scheduler process these modules are already imported, the hooks run at once, and the snapshot patch looks the
algorithm up by name.
"""
from __future__ import annotations

from types import ModuleType

from sglang_ext.patches.wrap import when_imported, wrap
from sglang_ext.names import ALGORITHM


def _forces_eagle_topk_one_as_dflash() -> None:
    """arg_groups/model_override_base.py `_forces_eagle_topk_one` matches DFLASH by name. It runs before
    `_handle_dflash` sets topk = 1 and, on SM100/SM103, picks the default target attention backend (trtllm_mha for
    DFLASH, flashinfer otherwise): DFLASH_ADAPTIVE must get DFLASH's answer (tests/unit/test_algorithm_name_sites.py)."""

    def make(original):
        def _forces_eagle_topk_one(speculative_algorithm) -> bool:
            return str(speculative_algorithm).upper() == ALGORITHM or original(speculative_algorithm)

        return _forces_eagle_topk_one

    def patch(mob: ModuleType) -> None:
        wrap(mob, "_forces_eagle_topk_one", make)  # looked up at call time by get_default_attn_backend

    when_imported("sglang.srt.arg_groups.model_override_base", patch)


def _fpm_spec_decode_snapshot() -> None:
    """metrics_reporter `snapshot_spec_decode_metrics` takes its pre-settle decode-KV snapshot only for the enum
    members in _SPEC_DECODE_SNAPSHOT_ALGORITHMS (forward-pass metrics); add ours next to DFLASH."""

    def patch(mr: ModuleType) -> None:
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        algo = SpeculativeAlgorithm.from_string(ALGORITHM)
        if algo not in mr._SPEC_DECODE_SNAPSHOT_ALGORITHMS:
            mr._SPEC_DECODE_SNAPSHOT_ALGORITHMS = (*mr._SPEC_DECODE_SNAPSHOT_ALGORITHMS, algo)

    when_imported("sglang.srt.managers.scheduler_components.metrics_reporter", patch)


def install() -> None:
    _forces_eagle_topk_one_as_dflash()
    _fpm_spec_decode_snapshot()
