"""Patches of SGLang 0.5.23 that let the CPU layer serve target families with sliding-window attention and
attention sinks (Gemma 4, gpt-oss) on the torch-native backend (only when the CPU layer is active).

Each patch names the call site it serves, why, and what would retire it; the pure-torch code is in
`sglang_ext/cpu/attention.py`.
"""
from __future__ import annotations

from types import ModuleType

from sglang_ext.patches.wrap import when_imported, wrap

def install() -> None:
    """One patch (sglang_ext.patches.install applies it once, with the CPU layer)."""
    _torch_native_for_windowed_families()


def _torch_native_for_windowed_families() -> None:
    """arg_groups/model_hook.py `handle_model_specific_adjustments` asserts a GPU attention backend for Gemma 4
    and gpt-oss (its reason: "torch_native has neither sliding window nor attention sinks"), through its name
    `attention_backends_of`, read only by those two asserts. On CPU the torch-native backend applies sliding
    windows (upstream's extend/decode masks; cpu/attention.py for verify and decode) and, with the CPU layer,
    attention sinks (`_torch_native_sinks`), so torch_native is answered as an accepted backend there. Retired by
    upstream accepting torch_native for them (sliding window and sinks in its torch-native backend)."""

    def make(original):
        def attention_backends_of(view):
            prefill, decode = original(view)
            ok = "intel_amx"  # in both asserts' accepted lists: CPU attention that reads windows and sinks
            return (ok if prefill == "torch_native" else prefill), (ok if decode == "torch_native" else decode)

        return attention_backends_of

    def patch(mh: ModuleType) -> None:
        wrap(mh, "attention_backends_of", make)

    when_imported("sglang.srt.arg_groups.model_hook", patch)
