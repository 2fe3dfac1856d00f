"""Size DFlash's decode reserve alike in the req_to_token rows, the decode allocation and the scheduler's
estimate (all devices; DFLASH and DFLASH_ADAPTIVE).

What: SGLang 0.5.23 gives every req_to_token row `context_len + 4 + speculative_num_draft_tokens` slots
(mem_cache/allocation_sizing.py `get_req_to_token_extra_context_len`), while DFlash's decode step reserves
`2 * block_size` slots past the committed length (speculative/dflash_info_v2.py `prepare_for_decode`). The rows are
widened by that reserve. A DDTree width w above the block B writes w slots one step ahead of the host's committed
lengths, so the reserve becomes w + B for the widest candidate (`page_aligned_decode_alloc_lens`, wrapped where
`prepare_for_decode` imports it by name), and the rows and the scheduler's decode-memory estimate
(`get_alloc_reserve_per_decode`, read by managers/schedule_batch.py `check_decode_mem`) grow by the same amount.

Why: a request decoding close to its context length (no `max_tokens`, a model that does not stop) would write past
its row -- on CPU the scheduler dies on an IndexError, on GPU the Triton kernel writes into another request's row --
and an estimate below the allocation lets a full pool pass the check, so the allocation raises "Out of memory"
where the scheduler should have retracted. How it was found: docs/HISTORY.md.

Retired by: upstream sizing DFlash's reserve (the rows, the decode allocation and the scheduler's estimate) from
the verify width the worker uses.
"""
from __future__ import annotations

from types import ModuleType

from sglang_ext.patches.wrap import when_imported, wrap

SIZING = "sglang.srt.mem_cache.allocation_sizing"
CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator"
DECODE_INFO = "sglang.srt.speculative.dflash_info_v2"
SCHEDULE_BATCH = "sglang.srt.managers.schedule_batch"


def tree_extra(num_draft_tokens: int) -> int:
    """Slots a DDTree window needs past the 2x-block reserve (0 without trees, or for a tree that fits the block)."""
    from sglang_ext.settings import adaptive_settings

    widths = adaptive_settings().controller.candidates_for(num_draft_tokens)
    return max(0, max(widths) - num_draft_tokens)


def dflash_extra(num_draft_tokens: int, page_size: int) -> int:
    """Row headroom DFlash's decode needs: its 2x-block reserve (and a tree window's), page rounding, and
    upstream's 4 spare slots."""
    return 2 * num_draft_tokens + tree_extra(num_draft_tokens) + max(page_size, 1) - 1 + 4


def _serves_dflash() -> bool:
    from sglang.srt.runtime_context import get_spec
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    name = get_spec().speculative_algorithm
    return name is not None and SpeculativeAlgorithm.from_string(name).is_dflash()


def _patch_sizing(sizing: ModuleType) -> None:
    def make_rows(original):
        def get_req_to_token_extra_context_len() -> int:
            extra = original()
            if not _serves_dflash():
                return extra
            block = sizing.max_speculative_num_draft_tokens() or 0
            return max(extra, dflash_extra(block, sizing.get_alloc_page_size()))

        return get_req_to_token_extra_context_len

    def make_reserve(original):
        def get_alloc_reserve_per_decode() -> int:
            reserve = original()
            if not _serves_dflash():
                return reserve
            return reserve + tree_extra(sizing.max_speculative_num_draft_tokens() or 0)

        return get_alloc_reserve_per_decode

    wrap(sizing, "get_req_to_token_extra_context_len", make_rows)
    wrap(sizing, "get_alloc_reserve_per_decode", make_reserve)


def _patch_decode_estimate(schedule_batch: ModuleType) -> None:
    # imported by name at module import: rebind its global to the widened reserve
    import importlib

    sizing = importlib.import_module(SIZING)
    _patch_sizing(sizing)
    schedule_batch.get_alloc_reserve_per_decode = sizing.get_alloc_reserve_per_decode


def _patch_configurator(configurator: ModuleType) -> None:
    # imported by name at module import: rebind its global as well
    import importlib

    sizing = importlib.import_module(SIZING)
    _patch_sizing(sizing)
    configurator.get_req_to_token_extra_context_len = sizing.get_req_to_token_extra_context_len


def _patch_decode_reserve(info: ModuleType) -> None:
    extra = {}

    def make(original):
        def page_aligned_decode_alloc_lens(reqs, *, reserve: int, page_size: int):
            block = reserve // 2  # prepare_for_decode: reserve = 2 * speculative_num_draft_tokens
            if block not in extra:
                extra[block] = tree_extra(block)
            return original(reqs, reserve=reserve + extra[block], page_size=page_size)

        return page_aligned_decode_alloc_lens

    wrap(info, "page_aligned_decode_alloc_lens", make)


def install() -> None:
    when_imported(SIZING, _patch_sizing)
    when_imported(CONFIGURATOR, _patch_configurator)
    when_imported(DECODE_INFO, _patch_decode_reserve)
    when_imported(SCHEDULE_BATCH, _patch_decode_estimate)
