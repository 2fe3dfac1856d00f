"""The support matrix: which target families and drafters each algorithm serves, and why one is refused.

docs/MODELS.md is this table in prose, row by row, with the test behind each row; the rules that read it
(sglang_ext/refusals.py ``target_refusal``, ``drafter_refusal``, ...) refuse a family outside it in the preflight,
before SGLang starts, with the reason instead of failing at start-up or at the first request. A row is "served"
only where a test serves it through a real server and compares greedy output token for token with plain decoding
(tests/integration/test_model_families.py). Data only: no torch, no SGLang, no imports. Other modules add rows
with ``register_target``.
"""
from __future__ import annotations

from dataclasses import dataclass

ALGORITHMS = ("none", "dflash", "dflash_adaptive")
MODELS_DOC = "docs/MODELS.md"


@dataclass(frozen=True)
class TargetRow:
    family: str  # the builder's name in dflash_models/families.py
    architecture: str  # config.json `architectures[0]`
    refused: dict[str, str]  # algorithm -> why it is refused; absent: served
    last_layer_capture: bool = False  # SGLang's model captures the last layer's output as a draft feature
    checkpoint_dtype_params: bool = False  # SGLang builds some of its weights in the checkpoint's dtype


TARGETS: dict[str, TargetRow] = {}


def register_target(row: TargetRow) -> TargetRow:
    if row.architecture in TARGETS:
        raise ValueError(f"target architecture {row.architecture} is already in the support matrix")
    unknown = set(row.refused) - set(ALGORITHMS)
    if unknown:
        raise ValueError(f"unknown algorithms {sorted(unknown)} in the row of {row.architecture}")
    TARGETS[row.architecture] = row
    return row


register_target(TargetRow("qwen3", "Qwen3ForCausalLM", {}))
register_target(TargetRow("llama3", "LlamaForCausalLM", {}))
register_target(TargetRow("qwen3_moe", "Qwen3MoeForCausalLM", {}))
register_target(TargetRow("gemma4", "Gemma4ForCausalLM", {}, last_layer_capture=True))
register_target(TargetRow("gpt_oss", "GptOssForCausalLM", {}, checkpoint_dtype_params=True))
# Qwen3.5 text (gated delta net + full attention): dflash_models/family_qwen3_5.py, served at chain widths only
# (refusals.py: trees, per-request widths and GPUs are refused for hybrid targets); tested by
# tests/integration/test_hybrid_target.py
register_target(TargetRow("qwen3_5", "Qwen3_5ForCausalLM", {}))


# Drafter architectures (the drafter's config.json `architectures[0]`) -> why dflash_adaptive refuses it (None:
# served). The worker refuses the heads that propose differently at start-up too (refusals.drafter_head_refusal).
DRAFTERS: dict[str, str | None] = {"DFlashDraftModel": None}
# DFlash2: a candidate selector walks one path through the target head's top-k per position (argmax for greedy
# rows, sampled with its q for sampled rows) and grouped convolutions run across the block. dflash_adaptive
# verifies the path's first b - 1 tokens at width b (a prefix of the walk is the walk's own distribution); trees
# and per-request widths are refused for it (refusals.py selector_*).
SELECTOR_DRAFTERS = frozenset({"DFlash2DraftModel", "DFlash2BeamDraftModel", "MiniMaxDFlash2DraftModel"})
for _name in SELECTOR_DRAFTERS:
    DRAFTERS[_name] = None


def is_selector_drafter(architecture: str | None) -> bool:
    """Whether a drafter of this architecture proposes through DFlash2's candidate selector."""
    return (architecture or "") in SELECTOR_DRAFTERS


def register_drafter(architecture: str, refusal: str | None) -> None:
    """Set a drafter's row (None: served), e.g. when a module makes dflash_adaptive serve one it refused."""
    DRAFTERS[architecture] = refusal
