"""Every config key the operator is told about exists: a key named in the docs (dotted, in backticks, or in a YAML
example), in the comments of the shipped configs, or in a message or comment of the code the operator runs
(`service/`, `sglang_ext/`) is a field of the config model (service/config.py), an `sglang serve` flag under
`sglang_args`, or a router flag under `fleet.router.args`. A wrong key sends the operator to a config that fails
to load (exit 2)."""
from __future__ import annotations

import ast
import io
import re
import tokenize
import types
import typing
from functools import lru_cache
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from service.config import ServeConfig
from tests.conftest import REPO

SECTIONS = tuple(ServeConfig.model_fields)
# A dotted name starting with a top-level section; not part of a longer name (`self.model.path`, `service/fleet.py`)
KEY = re.compile(r"(?<![\w./\-$])(?:%s)(?:\.[A-Za-z_][A-Za-z0-9_\-]*)+(?:\.\*(?!\*))?" % "|".join(SECTIONS))
FILE_SUFFIXES = {"py", "md", "json", "yaml", "yml", "txt", "safetensors", "jsonl", "toml", "sh"}

MARKDOWN = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"), REPO / "deploy" / "k8s" / "README.md",
                   REPO / "loadtest" / "README.md"])
CONFIG_YAML = sorted([*(REPO / "deploy" / "configs").glob("*.yaml"), *(REPO / "deploy" / "k8s").rglob("config.yaml"),
                      REPO / "docker-compose.yml"])
CODE = sorted([*(REPO / "service").rglob("*.py"), *(REPO / "sglang_ext").rglob("*.py")])


def _models(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return [m for arg in typing.get_args(annotation) for m in _models(arg)]
    return []


def _tree(model: type[BaseModel]) -> dict:
    """The config's keys as a nested dict: a sub-model's keys, or None for a leaf."""
    out: dict = {}
    for name, field in model.model_fields.items():
        subs = _models(field.annotation)
        out[name] = _tree(subs[0]) if subs else None
    return out


@lru_cache(maxsize=1)
def _pass_through() -> dict[tuple[str, ...], set[str]]:
    """The free-form sections and the flags their keys must be: SGLang's and the router's own parsers."""
    from service.router_args import router_parser
    from service.sglang_args import sglang_parser

    def dests(parser):
        return {a.dest for a in parser._actions if a.option_strings}

    return {("sglang_args",): dests(sglang_parser()), ("fleet", "router", "args"): dests(router_parser())}


def unknown(parts: tuple[str, ...]) -> str | None:
    """Why `parts` (a dotted key split) names no config key; None when it does. A trailing `*` names a section."""
    node: dict | None = _tree(ServeConfig)
    for i, part in enumerate(parts):
        if part == "*" and i == len(parts) - 1:
            return None if isinstance(node, dict) else f"{'.'.join(parts[:i])} is not a section"
        flags = _pass_through().get(parts[:i])
        if flags is not None:
            rest = parts[i:]
            if len(rest) != 1 or rest[0].replace("-", "_") not in flags:
                return f"{'.'.join(parts[:i])} takes flags by name; {'.'.join(rest)} is none"
            return None
        if not isinstance(node, dict) or part not in node:
            return f"no key {part!r} in {'.'.join(parts[:i]) or 'the top level'}"
        node = node[part]
    return None


def dotted(text: str) -> list[str]:
    return [m.group(0) for m in KEY.finditer(text) if m.group(0).rsplit(".", 1)[-1] not in FILE_SUFFIXES]


def _mapping_keys(data, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for key, value in data.items():
        path = (*prefix, str(key))
        out.append(path)
        if isinstance(value, dict) and path not in _pass_through():
            out += _mapping_keys(value, path)
        elif isinstance(value, dict):
            out += [(*path, str(k)) for k in value]
    return out


def yaml_example_keys(text: str) -> list[tuple[str, ...]]:
    """The keys of a YAML example that is (part of) a config: a mapping whose top-level keys are sections."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return []
    if not isinstance(data, dict) or not data or not all(k in SECTIONS for k in data):
        return []
    return _mapping_keys(data)


def markdown_keys(text: str) -> list[tuple[str, ...]]:
    keys = []
    for lang, block in re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M):
        if lang in ("yaml", "yml"):
            keys += yaml_example_keys(block)
        keys += [tuple(k.split(".")) for line in block.splitlines() if "#" in line
                 for k in dotted(line.split("#", 1)[1])]
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    for span in re.findall(r"`([^`\n]+)`", prose):
        keys += [tuple(k.split(".")) for k in dotted(span)]
        keys += yaml_example_keys(span)
    return keys


def yaml_comment_keys(text: str) -> list[tuple[str, ...]]:
    return [tuple(k.split(".")) for line in text.splitlines() if "#" in line for k in dotted(line.split("#", 1)[1])]


def code_keys(source: str) -> list[tuple[str, ...]]:
    """Keys named in the code's strings (messages, docstrings; an f-string's literal parts) and comments."""
    texts = [node.value for node in ast.walk(ast.parse(source))
             if isinstance(node, ast.Constant) and isinstance(node.value, str)]
    texts += [tok.string for tok in tokenize.generate_tokens(io.StringIO(source).readline)
              if tok.type == tokenize.COMMENT]
    return [tuple(k.split(".")) for text in texts for k in dotted(text)]


def _wrong(keys: list[tuple[str, ...]]) -> list[str]:
    return sorted({f"{'.'.join(k)}: {why}" for k in keys if (why := unknown(k))})


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(REPO)))
def test_keys_named_in_the_docs_exist(path: Path):
    assert _wrong(markdown_keys(path.read_text())) == []


@pytest.mark.parametrize("path", CONFIG_YAML, ids=lambda p: str(p.relative_to(REPO)))
def test_keys_named_in_config_comments_exist(path: Path):
    assert _wrong(yaml_comment_keys(path.read_text())) == []


def test_keys_named_in_messages_and_comments_of_the_code_exist():
    wrong = {str(p.relative_to(REPO)): bad for p in CODE if (bad := _wrong(code_keys(p.read_text())))}
    assert wrong == {}


def test_the_scan_finds_what_the_operator_reads():
    """The scan is not vacuous: it sees keys where the operator reads them, and refuses near misses."""
    deployment = markdown_keys((REPO / "docs" / "DEPLOYMENT.md").read_text())
    assert ("sglang_args", "mem_fraction_static") in deployment
    assert ("fleet", "router", "policy") in deployment
    readme = markdown_keys((REPO / "README.md").read_text())
    assert ("speculative", "draft_model_path") in readme  # from its YAML example
    worker = code_keys((REPO / "sglang_ext" / "worker.py").read_text())
    assert ("sglang_args", "mem_fraction_static") in worker
    assert _wrong(code_keys('log.warning("then lower model.mem_fraction_static")')) == [
        "model.mem_fraction_static: no key 'mem_fraction_static' in model"]
    assert _wrong(markdown_keys("lower `sglang_args.mem_fraction_statik`")) == [
        "sglang_args.mem_fraction_statik: sglang_args takes flags by name; mem_fraction_statik is none"]
    assert _wrong(markdown_keys("```yaml\nspeculative:\n  adaptive:\n    candidate: [1, 2]\n```\n")) == [
        "speculative.adaptive.candidate: no key 'candidate' in speculative.adaptive"]
    assert _wrong(markdown_keys("`speculative.adaptive.*` and `server.*`, not `self.model.foo` nor `fleet.py`")) == []
