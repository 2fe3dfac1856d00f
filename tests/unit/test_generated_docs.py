"""The docs a user reads stay true: the generated references match the code that defines them, every relative
link in the Markdown docs reaches an existing file (and heading), and the README stays a short manual that names
the command CI runs."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"), REPO / "benchmarks" / "results" / "HISTORY.md"])
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def test_generated_references_match_the_code():
    run = subprocess.run([sys.executable, "scripts/gen_reference.py", "--check"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


def _anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
    return {slug if n == 0 else f"{slug}-{n}" for slug, count in seen.items() for n in range(count + 1)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(doc: Path):
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{target} (no such heading)")
    assert broken == []


def test_readme_is_a_short_manual_naming_the_ci_command():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd ", "export "))]
    assert ci and all(line in readme for line in ci), ci
    assert "scripts/install-cpu.sh && dflash-serve serve --config deploy/configs/cpu.yaml" in readme
