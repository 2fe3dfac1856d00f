"""The product wheel: what pyproject ships runs without the dev tree. Every first-party import (lazy ones too) of a
shipped module names a shipped module, and the dev harness and model training stay out."""
from __future__ import annotations

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIRST_PARTY = ("sglang_ext", "service", "harness", "dflash_models", "loadtest", "benchmarks", "deploy", "tests")


def shipped() -> set[Path]:
    wheel = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"]
    files: set[Path] = set()
    for entry in wheel["only-include"]:
        path = REPO / entry
        files |= set(path.rglob("*.py")) if path.is_dir() else {path}
    return {p.relative_to(REPO) for p in files if "__pycache__" not in p.parts}


def module_file(module: str) -> set[Path]:
    """The files that must ship for ``module`` to import: the packages on its way and the module; the parts past a
    module are names in it (``from pkg.mod import name``)."""
    parts, need = module.split("."), set()
    for i in range(1, len(parts) + 1):
        package, mod = Path(*parts[:i], "__init__.py"), Path(*parts[:i]).with_suffix(".py")
        if (REPO / package).is_file():
            need.add(package)
        elif (REPO / mod).is_file():
            return need | {mod}
        else:
            break
    return need


def first_party_imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse((REPO / path).read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in out if m.split(".")[0] in FIRST_PARTY}


def test_every_shipped_module_imports_only_shipped_modules():
    files = shipped()
    missing = {f"{path}: {module}" for path in files if path.suffix == ".py"
               for module in first_party_imports(path) if not module_file(module) <= files}
    assert not missing, sorted(missing)


def test_the_wheel_ships_the_product_and_the_test_pair_builder_but_no_dev_harness_or_training():
    tops = {p.parts[0] for p in shipped()}
    assert {"sglang_ext", "service", "dflash_models"} <= tops
    assert not tops & {"harness", "tests", "benchmarks", "loadtest"}
    assert Path("dflash_models/tiny.py") in shipped()  # dflash-serve make-test-models
    assert not {Path("dflash_models/build.py"), Path("dflash_models/regen.py")} & shipped()
