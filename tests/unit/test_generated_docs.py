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


# -- every repository path the prose names exists --------------------------------------------------------------------

ROOTS = ("sglang_ext", "service", "harness", "dflash_models", "loadtest", "benchmarks", "deploy", "tests", "models",
         "docs", "scripts", ".ci", "requirements")
# a path: one of ROOTS, then path characters; one followed by `<` or `{` is a pattern (`gpu-<card>-check/`)
NAMED_PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./*-]*)(?![\w./*<{-])" % "|".join(re.escape(r) for r in ROOTS))
# named, but made by a command rather than committed: each with the file that makes it
MADE = {"models/tiny-random": "scripts/install-cpu.sh",
        "benchmarks/results/gpu_throughput.json": "tests/gpu/test_gpu_serving.py"}


def _tracked(*patterns: str) -> list[Path]:
    out = subprocess.run(["git", "ls-files", *patterns], cwd=REPO, capture_output=True, text=True, check=True)
    return [REPO / p for p in out.stdout.split() if not p.startswith("benchmarks/results/") or p.endswith("HISTORY.md")]


def _prose_of_python(path: Path) -> str:
    """A module's docstrings and comments: what a reader takes for documentation, not the paths its code builds."""
    import ast
    import io
    import tokenize

    source = path.read_text()
    parts = [ast.get_docstring(node, clean=False) or "" for node in ast.walk(ast.parse(source))
             if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    parts += [tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
              if tok.type == tokenize.COMMENT]
    return "\n".join(parts)


def _upstream_srt() -> Path | None:
    """SGLang's `srt/` folder, which docstrings cite as `models/dflash.py` and the like, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    return Path(spec.origin).parent / "srt" if spec and spec.origin else None


PROSE = sorted(_tracked("*.md", "*.yml", "*.yaml", "*.py", "Dockerfile"))


def _named_paths(path: Path) -> set[str]:
    text = _prose_of_python(path) if path.suffix == ".py" else path.read_text()
    return {m.rstrip(".") for m in NAMED_PATH.findall(text)}


def _exists(name: str, upstream: Path | None) -> bool:
    name = name.split("::")[0]
    if "*" in name:
        return bool(list(REPO.glob(name)))
    if any(name == made or name.startswith(made + "/") for made in MADE):
        return True
    return ((REPO / name).exists() or (REPO / name).with_suffix(".py").exists()
            or (upstream is not None and (upstream / name).exists()))


def test_every_made_path_is_made_where_it_says():
    for made, maker in MADE.items():
        assert made in (REPO / maker).read_text(), (made, maker)


def test_every_repository_path_the_docs_comments_and_docstrings_name_exists():
    """README, docs/, the compose file, the k8s and Prometheus YAML and every module's docstrings and comments:
    a file moved or renamed fails here, where the reader would have followed a dead name."""
    upstream = _upstream_srt()
    missing = sorted(f"{path.relative_to(REPO)}: {name}" for path in PROSE for name in _named_paths(path)
                     if "__pycache__" not in name and not _exists(name, upstream))
    assert len(PROSE) > 100
    assert missing == []


# a Markdown file's path, then one quoted heading or two joined by "and", across a comment's line break too
SECTION = re.compile(r"((?:[\w.-]+/)*[\w-]+\.md)[,:]?\s+(?:#\s+)?\"([^\"\n]{2,60})\"(?:\s+and\s+\"([^\"\n]{2,60})\")?")


def _headings(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return [re.sub(r"^§\d+ ", "", h.strip().lower()) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)]


def test_every_section_cited_by_title_exists():
    """`docs/DEPLOYMENT.md, "Docker Compose"`: a cited heading (or the start of one) is still in that file."""
    cited = []
    for path in PROSE:
        text = _prose_of_python(path) if path.suffix == ".py" else path.read_text()
        for doc, *titles in SECTION.findall(text):
            target = next((p for p in (REPO / doc, path.parent / doc) if p.is_file()), None)
            assert target is not None, f"{path.relative_to(REPO)} cites {doc}, which does not exist"
            cited += [(str(path.relative_to(REPO)), doc, t) for t in titles
                      if t and not any(h.startswith(t.lower()) for h in _headings(target))]
    assert cited == []


def test_deployment_doc_counts_and_names_every_dashboard_that_ships():
    import json

    titles = sorted(json.loads(f.read_text())["title"].removeprefix("dflash-serve: ").lower()
                    for f in (REPO / "deploy/grafana/dashboards").glob("*.json"))
    doc = (REPO / "docs" / "DEPLOYMENT.md").read_text()
    words = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}
    counted = set(re.findall(r"\b(two|three|four|five|six) dashboards\b", doc))
    assert counted == {words[len(titles)]}
    named = {t.lower() for t in re.findall(r"\*([\w ]+)\*", doc)}
    assert [t for t in titles if not any(t.startswith(n) for n in named)] == []


def test_readme_and_adaptive_quote_the_regret_figure_of_its_json():
    """Real-world code, live at one user: the share of requests within 10 % of their best fixed width, one figure
    from benchmarks/results/regret_cpu.json wherever it is quoted."""
    import json

    summary = json.loads((REPO / "benchmarks/results/regret_cpu.json").read_text())["workloads"]["realcode"]["summary"]
    within = round(100 * (1 - summary["vs_best_fixed"]["share_worse_10pct"]))
    for doc in ("README.md", "docs/ADAPTIVE.md"):
        text = " ".join((REPO / doc).read_text().split())
        quoted = re.findall(r"best fixed width for (\d+) % of requests", text)
        assert quoted == [str(within)], doc


def test_a_commands_results_links_point_into_the_folder_it_writes():
    """A paragraph that gives a command writing `--out` into a results folder links reports under that folder only."""
    checked = 0
    for doc in DOCS:
        for para in re.split(r"\n\s*\n", doc.read_text()):
            outs = re.findall(r"--out\s+(benchmarks/results/[\w./-]+)", para)
            if len(outs) != 1:
                continue
            links = [t for t in LINK.findall(para) if "benchmarks/results/" in t]
            folder = outs[0].rstrip("/") + "/"
            assert [t for t in links if folder not in t] == [], (doc.name, folder)
            checked += bool(links)
    assert checked
