"""The support matrix: which target families and drafters each algorithm serves, and why one is refused.

docs/MODELS.md is this table in prose, row by row, with the test behind each row; the preflight
(service/preflight.py) enforces it before SGLang starts, so a family outside it is refused with the reason instead
of failing at start-up or at the first request. A row is "served" only where a test serves it through a real
server and compares greedy output token for token with plain decoding (tests/integration/test_model_families.py).
Pure: no torch, no SGLang. Other modules add rows with ``register_target``.
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


def target_refusal(architecture: str | None, algorithm: str) -> str | None:
    """Why `algorithm` does not serve a target of this architecture (None: it serves). Plain decoding is SGLang's
    own and never refused here; upstream's `dflash` is refused only where its row says so (a family outside the
    matrix keeps upstream's own checks); `dflash_adaptive` serves the matrix's rows only."""
    if algorithm == "none":
        return None
    row = TARGETS.get(architecture or "")
    if row is not None:
        return row.refused.get(algorithm)
    if algorithm == "dflash_adaptive":
        return (f"target architecture {architecture} is not in the support matrix ({MODELS_DOC}): dflash_adaptive "
                f"has not been tested with it; serve it with speculative.algorithm: dflash")
    return None


def dtype_refusal(architecture: str | None, served: str, checkpoint: str | None) -> str | None:
    """Why the target cannot run in the served dtype (None: it can). gpt-oss builds its attention projections in
    the checkpoint's dtype (models/gpt_oss.py GptOssAttention params_dtype=config.dtype), so serving a bf16
    checkpoint in another dtype fails at the first forward with mismatched matmul dtypes."""
    row = TARGETS.get(architecture or "")
    if row is None or not row.checkpoint_dtype_params or served == "auto" or checkpoint in (None, served):
        return None
    return (f"{architecture} runs its attention projections in the checkpoint's dtype {checkpoint}, not "
            f"{served}: set model.dtype: {checkpoint} (or auto)")


def last_layer_refusal(architecture: str | None, layer_ids: list[int], n_layers: int) -> str | None:
    """Why these draft feature layers cannot be captured (None: they can). SGLang captures target layer k's output
    as the input of layer k + 1, so most models never see k = n - 1: Qwen3-MoE's index fails at start-up, the
    dense models capture one feature short and the drafter's fc layer fails on it in the first forward."""
    row = TARGETS.get(architecture or "")
    if n_layers - 1 not in layer_ids or (row is not None and row.last_layer_capture):
        return None
    return (f"dflash_config.target_layer_ids {layer_ids} include the target's last layer {n_layers - 1}, whose "
            f"output SGLang does not capture for {architecture}; use a drafter whose layers are 0..{n_layers - 2}")


# Drafter architectures (the drafter's config.json `architectures[0]`) -> why dflash_adaptive refuses it (None:
# served). The worker refuses the heads that propose differently at start-up too (worker.py _refuse_unsupported).
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


def drafter_refusal(architecture: str | None, algorithm: str) -> str | None:
    """Why `algorithm` does not serve a drafter of this architecture (None: it serves); upstream's `dflash` keeps
    its own checks."""
    if algorithm != "dflash_adaptive":
        return None
    arch = architecture or "DFlashDraftModel"  # none named: read as the plain drafter; SGLang's loader decides
    if arch not in DRAFTERS:
        return (f"drafter architecture {arch} is not in the support matrix ({MODELS_DOC}): dflash_adaptive has not "
                f"been tested with it; serve it with speculative.algorithm: dflash")
    why = DRAFTERS[arch]
    return None if why is None else f"drafter architecture {arch}: {why}; serve it with speculative.algorithm: dflash"


# Why dflash_adaptive refuses a drafter served with a draft window (upstream's `dflash` serves it): the adaptive
# steps write and read the draft KV at the target's own req_to_token slots (steps/window.py, steps/draft_kv.py),
# which the compact window replaces with a draft-local view rebuilt from committed state each iteration.
DRAFT_WINDOW_REFUSAL = ("dflash_adaptive does not serve a draft window: its steps keep the draft KV at the "
                        "target's own KV slots, which the compact window replaces; unset "
                        "sglang_args.speculative_draft_window_size or serve with speculative.algorithm: dflash")


def draft_window_refusal(sglang_args: dict, algorithm: str) -> str | None:
    """Why this algorithm does not serve the configured draft window (None: it serves, or none is set)."""
    window = sglang_args.get("speculative_draft_window_size", sglang_args.get("speculative-draft-window-size"))
    return DRAFT_WINDOW_REFUSAL if window is not None and algorithm == "dflash_adaptive" else None
