"""docs/ARCHITECTURE.md stays the true map: every file it names exists, every section the code cites exists, and
every SGLang patch module has its entry in §5."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = (REPO / "docs" / "ARCHITECTURE.md").read_text()
ROOTS = ("sglang_ext/", "service/", "harness/", "dflash_models/", "loadtest/", "benchmarks/", "deploy/", "tests/",
         "models/", "docs/", "scripts/", ".ci/")


def _exists(name: str) -> bool:
    path = REPO / name
    return path.exists() or path.with_suffix(".py").exists()


def test_every_path_it_names_exists():
    named = {m for m in re.findall(r"`([\w./-]+)`", DOC) if m.startswith(ROOTS)}
    assert len(named) > 20
    assert sorted(n for n in named if not _exists(n.split(" ")[0])) == []


def test_sglang_ext_modules_it_names_by_file_exist():
    for module in re.findall(r"`((?:patches|cpu)/\w+\.py)`", DOC):
        assert (REPO / "sglang_ext" / module).is_file(), module


def test_every_cited_section_exists():
    sections = set(re.findall(r"^## §(\d+)", DOC, flags=re.M))
    cited = []
    for path in REPO.rglob("*"):
        if path.is_file() and ".git" not in path.parts and path.suffix in (".py", ".md", ".yml", ".yaml"):
            cited += [(str(path.relative_to(REPO)), n) for n in re.findall(r"ARCHITECTURE\.md §(\d+)", path.read_text())]
    assert cited, "the code cites the architecture doc"
    assert [c for c in cited if c[1] not in sections] == []


def test_every_patch_module_is_in_the_table():
    from sglang_ext import patches

    section = DOC[DOC.index("## §5"):DOC.index("## §6")]
    for name, _ in patches.ALL_DEVICES + patches.CPU_ONLY:
        assert f"\n- **`{name}`**" in section, name
