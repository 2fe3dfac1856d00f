"""The support matrix (sglang_ext/support.py, its rules in sglang_ext/refusals.py, docs/MODELS.md): the preflight
refuses what dflash_adaptive does not serve, with the reason and the fix, and never refuses silently: every draft
architecture upstream's DFLASH serves and every target family upstream's DFLASH worker accepts is either served by
dflash_adaptive or named in docs/MODELS.md with the reason (the parity guard, read from SGLang's own model sources)."""
from __future__ import annotations

import ast
import functools
import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from service.config import ConfigError, load_config
from service.preflight import check
from sglang_ext import refusals, support
from tests.conftest import REPO

SGLANG_MODELS = Path(importlib.util.find_spec("sglang").submodule_search_locations[0]) / "srt" / "models"
REFUSED_HEADING = "## Refused by dflash_adaptive"


def _entry_names(value: ast.expr) -> list[str]:
    items = value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]
    return [i.id for i in items if isinstance(i, ast.Name)]


def _read_models() -> tuple[dict[str, list[tuple[list[str], set[str]]]], dict[str, list[str]]]:
    """SGLang's model sources: every top-level class (its base names, its methods) and each file's EntryClass
    (the names the model registry serves, keyed by class name)."""
    classes: dict[str, list[tuple[list[str], set[str]]]] = {}
    entries: dict[str, list[str]] = {}
    for path in sorted(SGLANG_MODELS.rglob("*.py")):
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
                classes.setdefault(node.name, []).append((bases, methods))
            elif isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "EntryClass" for t in node.targets):
                entries[path.stem] = _entry_names(node.value)
    return classes, entries


def _defines(classes, name: str, method: str, seen: set[str] | None = None) -> bool:
    seen = seen if seen is not None else set()
    if name in seen or name not in classes:
        return False
    seen.add(name)
    return any(method in methods or any(_defines(classes, b, method, seen) for b in bases)
               for bases, methods in classes[name])


@functools.lru_cache(maxsize=1)
def upstream_dflash() -> tuple[list[str], list[str]]:
    """(draft architectures models/dflash.py serves, target architectures the DFLASH worker accepts: registry
    entries with `set_dflash_layers_to_capture`, which model_runner's aux-hidden capture requires)."""
    classes, entries = _read_models()
    drafts = entries["dflash"]
    targets = sorted({n for names in entries.values() for n in names
                      if _defines(classes, n, "set_dflash_layers_to_capture")})
    return drafts, targets


def refused_section(doc: str) -> str:
    start = doc.index(REFUSED_HEADING)
    end = doc.find("\n## ", start + len(REFUSED_HEADING))
    return doc[start:end if end != -1 else len(doc)]


def unexplained(doc: str, drafts: list[str], targets: list[str]) -> list[str]:
    """The architectures dflash_adaptive refuses that docs/MODELS.md's refused section does not name."""
    section = refused_section(doc)
    refused = ([d for d in drafts if refusals.drafter_refusal(d, "dflash_adaptive") is not None]
               + [t for t in targets if refusals.target_refusal(t, "dflash_adaptive") is not None])
    return [a for a in refused if f"`{a}`" not in section]


def test_upstream_dflash_is_read_from_sglang():
    drafts, targets = upstream_dflash()
    assert {"DFlashDraftModel", "DFlash2DraftModel"} <= set(drafts)
    assert {"Qwen3ForCausalLM", "LlamaForCausalLM", "Qwen3MoeForCausalLM", "Gemma4ForCausalLM",
            "GptOssForCausalLM"} <= set(targets)


def test_every_refusal_of_what_upstream_serves_is_explained_in_models_doc():
    doc = (REPO / support.MODELS_DOC).read_text()
    missing = unexplained(doc, *upstream_dflash())
    assert not missing, (f"dflash_adaptive refuses {missing}, which upstream DFLASH serves, and {support.MODELS_DOC} "
                         f"does not say why: add them to its '{REFUSED_HEADING}' section with the reason")


def test_the_guard_fails_on_a_refusal_without_a_line():
    doc = (REPO / support.MODELS_DOC).read_text()
    drafts, targets = upstream_dflash()
    assert unexplained(doc.replace("`MuseGlimmerAssistantModel`", "MuseGlimmer"), drafts, targets) == [
        "MuseGlimmerAssistantModel"]


def test_every_matrix_row_has_a_builder_and_a_line_in_the_doc():
    from dflash_models import families

    doc = (REPO / support.MODELS_DOC).read_text()
    for row in support.TARGETS.values():
        assert families.FAMILIES[row.family].architecture == row.architecture
        assert re.search(rf"^\|[^\n]*`{row.architecture}`", doc, re.M), f"{row.architecture}: no row in the table"


# -- the preflight enforces it ----------------------------------------------------------------------------------

@pytest.fixture
def pair(random_pair, tmp_path) -> dict[str, Path]:
    """A copy of the random pair (4 layers) whose config.json files the tests edit."""
    out = {}
    for key in ("target", "drafter"):
        out[key] = tmp_path / key
        shutil.copytree(random_pair[key], out[key])
    return out


def _edit(directory: Path, **fields) -> None:
    cfg = json.loads((directory / "config.json").read_text())
    for key, value in fields.items():
        if key == "target_layer_ids":
            cfg["dflash_config"]["target_layer_ids"] = value
        else:
            cfg[key] = value
    (directory / "config.json").write_text(json.dumps(cfg))


def _check(tmp_path: Path, pair, algorithm: str, dtype: str = "float32", **sglang_args):
    data = {"model": {"path": str(pair["target"]), "dtype": dtype},
            "speculative": {"algorithm": algorithm, "draft_model_path": str(pair["drafter"])}}
    if algorithm == "none":
        data["speculative"] = {"algorithm": "none"}
    if sglang_args:
        data["sglang_args"] = sglang_args
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return check(load_config(path))


def test_a_target_outside_the_matrix_is_refused_by_dflash_adaptive_only(tmp_path, pair):
    _edit(pair["target"], architectures=["DeepseekV3ForCausalLM"])
    with pytest.raises(ConfigError, match=r"^model.path: target architecture DeepseekV3ForCausalLM is not in the "
                                          r"support matrix \(docs/MODELS.md\).*speculative.algorithm: dflash$"):
        _check(tmp_path, pair, "dflash_adaptive")
    _check(tmp_path, pair, "dflash")
    _check(tmp_path, pair, "none")


@pytest.mark.parametrize("architecture", sorted(support.SELECTOR_DRAFTERS))
def test_a_dflash2_drafter_is_served_at_chain_widths_and_its_trees_and_ragged_steps_refused(tmp_path, pair,
                                                                                          architecture):
    _edit(pair["drafter"], architectures=[architecture])
    _check(tmp_path, pair, "dflash_adaptive")
    _check(tmp_path, pair, "dflash")
    with pytest.raises(ConfigError, match=r"^speculative.adaptive.candidates: .*cannot take a DFlash2 drafter: its "
                                          r"candidate selector proposes one path"):
        _check_adaptive(tmp_path, pair, candidates=[1, 2, 4, 8, 16, 32])
    with pytest.raises(ConfigError, match=r"^speculative.adaptive.per_request_widths: the drafter is DFlash2: .*"
                                          r"set it false"):
        _check_adaptive(tmp_path, pair, per_request_widths=True)
    _check_adaptive(tmp_path, pair, candidates=[1, 2, 4, 8, 16])


def test_block_verification_with_a_dflash2_drafter_is_refused_on_cpu(tmp_path, pair):
    """Upstream `dflash` would crash at the first sampled request: the CPU sampler verifies token by token only."""
    _edit(pair["drafter"], architectures=["DFlash2DraftModel"])
    with pytest.raises(ConfigError, match=r"^sglang_args.speculative_use_block_verification: on CPU a DFlash2 "
                                          r"drafter's path is verified token by token.*unset it on CPU"):
        _check(tmp_path, pair, "dflash", speculative_use_block_verification=True)
    _edit(pair["drafter"], architectures=["DFlashDraftModel"])
    _check(tmp_path, pair, "dflash", speculative_use_block_verification=True)


def _check_adaptive(tmp_path: Path, pair, **adaptive):
    data = {"model": {"path": str(pair["target"]), "dtype": "float32"},
            "speculative": {"algorithm": "dflash_adaptive", "draft_model_path": str(pair["drafter"]),
                            "adaptive": adaptive}}
    path = tmp_path / "adaptive.yaml"
    path.write_text(yaml.safe_dump(data))
    return check(load_config(path))


def test_a_draft_window_is_refused_by_dflash_adaptive(tmp_path, pair):
    with pytest.raises(ConfigError, match=r"^sglang_args.speculative_draft_window_size: dflash_adaptive does not "
                                          r"serve a draft window"):
        _check(tmp_path, pair, "dflash_adaptive", speculative_draft_window_size=32)
    _check(tmp_path, pair, "dflash", speculative_draft_window_size=32)


def test_the_last_target_layer_is_refused_where_sglang_does_not_capture_it(tmp_path, pair):
    _edit(pair["drafter"], target_layer_ids=[1, 3])
    for algorithm in ("dflash", "dflash_adaptive"):
        with pytest.raises(ConfigError, match=r"^speculative.draft_model_path: dflash_config.target_layer_ids "
                                              r"\[1, 3\] include the target's last layer 3.*layers are 0..2$"):
            _check(tmp_path, pair, algorithm)
    assert refusals.last_layer_refusal("Gemma4ForCausalLM", [1, 3], 4) is None  # Gemma 4 captures it


def test_gpt_oss_in_another_dtype_than_its_checkpoint_is_refused(tmp_path, pair):
    _edit(pair["target"], architectures=["GptOssForCausalLM"], dtype="bfloat16")
    with pytest.raises(ConfigError, match=r"^model.dtype: GptOssForCausalLM runs its attention projections in the "
                                          r"checkpoint's dtype bfloat16, not float32: set model.dtype: bfloat16"):
        _check(tmp_path, pair, "none")
    _check(tmp_path, pair, "none", dtype="bfloat16")
