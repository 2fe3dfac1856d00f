"""The rooms of the tree and what each may import (docs/ARCHITECTURE.md "Rooms"): no folder imports one above it.

Found by reading every import statement (module level and inside functions) of every first-party file, so a
lazy import counts too."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FIRST_PARTY = ("sglang_ext", "service", "harness", "dflash_models", "loadtest", "benchmarks", "deploy", "tests")

# room -> the first-party rooms it may import (itself always). Order = layering, bottom first.
ALLOWED: dict[str, set[str]] = {
    "sglang_ext.controller": set(),  # pure: stdlib + numpy (tests/unit/controller/test_controller_imports.py)
    "sglang_ext.names": set(),
    "sglang_ext.settings": {"sglang_ext.names", "sglang_ext.controller"},
    "sglang_ext.controller_loop": {"sglang_ext.controller", "sglang_ext.settings"},
    "sglang_ext.cpu": {"sglang_ext.names"},
    "sglang_ext.verify_rows": set(),  # torch only
    "sglang_ext.tree": set(),  # torch only
    "sglang_ext.support": set(),  # the support matrix's rows: data only
    "sglang_ext.refusals": {"sglang_ext.names", "sglang_ext.support"},  # every refusal rule: no sglang, no torch
    "sglang_ext.capture": {"sglang_ext.settings"},  # the capture store's writer (no sglang, no torch)
    "sglang_ext.patches": {"sglang_ext.names", "sglang_ext.settings", "sglang_ext.cpu", "sglang_ext.verify_rows",
                           "sglang_ext.tree", "sglang_ext.refusals", "sglang_ext.capture"},
    "sglang_ext": {"sglang_ext.controller", "sglang_ext.names", "sglang_ext.settings", "sglang_ext.controller_loop",
                   "sglang_ext.cpu", "sglang_ext.patches", "sglang_ext.verify_rows", "sglang_ext.tree",
                   "sglang_ext.support", "sglang_ext.refusals", "sglang_ext.capture"},
    "service": {"sglang_ext.controller", "sglang_ext.names", "sglang_ext.settings", "sglang_ext.cpu", "sglang_ext",
                "sglang_ext.support", "sglang_ext.refusals"},
    "harness": {"sglang_ext.controller"},
    "dflash_models": {"harness"},
}


def room(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "sglang_ext" and len(parts) > 1 and f"sglang_ext.{parts[1]}" in ALLOWED:
        return f"sglang_ext.{parts[1]}"
    return parts[0]


def imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}  # `from sglang_ext import env`
    return {m for m in out if m.split(".")[0] in FIRST_PARTY}


def first_party_files(top: str):
    return sorted(p for p in (REPO / top).rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("top", ["sglang_ext", "service", "harness", "dflash_models"])
def test_no_room_imports_one_above_it(top):
    bad = []
    for path in first_party_files(top):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        here = room(module)
        for target in imports(path):
            there = room(target)
            if target == "sglang_ext" or there == here:
                continue  # the bare package (its __init__ is empty) and the room itself
            if there not in ALLOWED[here]:
                bad.append(f"{path.relative_to(REPO)}: {here} imports {target} ({there})")
    assert not bad, "\n".join(bad)


def test_the_rules_name_real_rooms():
    for name in ALLOWED:
        path = REPO / name.replace(".", "/")
        assert path.is_dir() or path.with_suffix(".py").is_file(), name


def test_every_environment_variable_is_named_in_one_module():
    """The product's DFLASH_SERVE_* variables are spelled only in sglang_ext/names.py (and the .pth hook, which
    cannot import it, spells the CPU one: it must match)."""
    import re

    from sglang_ext import names

    spelled = []
    for top in ("sglang_ext", "service"):
        for path in first_party_files(top):
            if path.name != "names.py" and re.search(r"[\"']DFLASH_SERVE_\w+[\"']", path.read_text()):
                spelled.append(str(path.relative_to(REPO)))
    assert spelled == []
    pth = (REPO / "sglang_ext/cpu/dflash_serve_cpu.pth").read_text()
    assert re.findall(r"DFLASH_SERVE_\w+", pth) == [names.CPU]
