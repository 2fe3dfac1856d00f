"""Build loadtest/prompts/realcode.jsonl: completion prompts cut from real Python the bundled pair never saw.

    python -m loadtest.make_realcode [--per-package 6] [--tokens 300] [--out loadtest/prompts/realcode.jsonl]

Why: the bundled pair is trained on the stdlib (dflash_models/corpus.py leaves site-packages out), so prompts from
installed packages are code it has not seen. On them the drafter is right some of the time and very differently from
one prompt to the next -- the heterogeneous traffic a controller tuned on its own code mix must still serve well.

Each prompt is the source that precedes a function's body, cut at the function boundary: the lines before a `def`
(whole lines, about --tokens tokens of the bundled tokenizer) plus the `def` line itself, so the model continues
the body. Sent to /v1/completions as raw text (no chat template), as code-completion clients do. Functions are
picked evenly over each package's sorted files, so the file is the same on every machine with the same package
versions; the committed file is what benchmarks use, this script is how it was made.
"""
from __future__ import annotations

import argparse
import ast
import json
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "loadtest" / "prompts" / "realcode.jsonl"
TOKENIZER = REPO / "models" / "tiny-code" / "target"
# Pure-Python packages the install brings (scripts/install-cpu.sh), from several domains and code styles.
PACKAGES = ("requests", "yaml", "jinja2", "click", "urllib3", "packaging", "starlette", "werkzeug", "httpx",
            "anyio", "tqdm", "rich", "attr", "prometheus_client", "jsonschema", "filelock")


def _functions(path: Path) -> list[int]:
    """1-based line numbers of `def` lines (functions and methods) whose body is at least 4 lines."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    return sorted(n.lineno for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                  and not n.decorator_list and n.end_lineno is not None and n.end_lineno - n.lineno >= 4
                  and n.lineno == n.body[0].lineno - 1)   # a one-line signature: the prompt ends at its line


def _prompt(lines: list[str], def_line: int, tokens: int, count) -> str | None:
    """The whole lines ending with line `def_line`, as many as fit in `tokens` tokens (at least 8 lines)."""
    end = def_line  # exclusive index of the line after the def
    start = end - 1
    while start > 0 and count("".join(lines[start - 1:end])) <= tokens:
        start -= 1
    text = "".join(lines[start:end])
    return text if end - start >= 8 and text.strip() else None


def build(per_package: int, tokens: int) -> list[dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    count = lambda s: len(tok.encode(s, add_special_tokens=False))  # noqa: E731
    root = Path(sysconfig.get_paths()["purelib"])
    out = []
    for package in PACKAGES:
        files = sorted(p for p in (root / package).rglob("*.py") if "tests" not in p.parts and "test" not in p.parts)
        sites = [(f, line) for f in files for line in _functions(f)]
        if not sites:
            raise SystemExit(f"{package}: no functions found under {root / package}; is it installed?")
        step = max(1, len(sites) // per_package)
        taken = 0
        for f, line in sites[step // 2::step]:
            text = _prompt(f.read_text(encoding="utf-8").splitlines(keepends=True), line, tokens, count)
            if text is None:
                continue
            out.append({"prompt": text, "category": "realcode",
                        "source": f"{f.relative_to(root)}:{line}", "prompt_tokens": count(text)})
            taken += 1
            if taken == per_package:
                break
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--per-package", type=int, default=6)
    p.add_argument("--tokens", type=int, default=300, help="prompt length in tokens of the bundled tokenizer")
    p.add_argument("--out", type=Path, default=OUT)
    a = p.parse_args(argv)
    rows = build(a.per_package, a.tokens)
    a.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} prompts from {len(PACKAGES)} packages -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
