"""Generated configs: `dflash-serve check` (the YAML loader, the config model, model resolution, the preflight, the
argument building and a GPU config's memory plan) under documents hypothesis builds from the config's own schema.
Every one either passes or exits 2 with one line naming the field; none raises.

A document starts from a config that passes (the tiny random pair, dflash_adaptive) and gets a few edits: a key
of the schema (every section's fields, the adaptive controller's, the sglang_args the preflight reads) set to a
generated value, removed, or a key added; or it is not a mapping at all, or not YAML. What earlier runs found
is kept as explicit examples (FOUND). Bounded for CI (DFLASH_CONFIG_FUZZ_EXAMPLES, default 150: a few seconds;
SGLang is not imported, its parser is tests/unit/test_config_errors.py's business).
"""
from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings, strategies as st
from pydantic import BaseModel

from service import cli
from service.config import CONTROLLER_KEYS, ServeConfig

EXAMPLES = int(os.environ.get("DFLASH_CONFIG_FUZZ_EXAMPLES", "150"))
# sglang_args keys the preflight and the launcher read themselves (the rest only SGLang's parser reads)
READ_SGLANG_ARGS = ("tp_size", "page_size", "attention_backend", "nnodes", "node_rank", "tokenizer_worker_num",
                    "enable_watermark", "speculative_draft_window_size", "speculative_use_block_verification",
                    "preferred_sampling_params", "sampling_defaults", "disable_overlap_schedule", "kv_cache_dtype",
                    "mem_fraction_static", "chunked_prefill_size", "cuda_graph_max_bs_decode", "dist_init_addr")
SECTIONS = ("model", "server", "speculative", "fleet", "learning", "sglang_args")
ONE_LINE = re.compile(r"dflash-serve: error: (?P<field>\(top level\)|[^\s:]+): \S")


def _field_paths(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = []
    for name, info in model.model_fields.items():
        paths.append(prefix + (name,))
        for arg in (info.annotation, *getattr(info.annotation, "__args__", ())):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                paths += _field_paths(arg, prefix + (name,))
    return paths


SCHEMA_PATHS = _field_paths(ServeConfig) + [("speculative", "adaptive", k) for k in CONTROLLER_KEYS]
SGLANG_PATHS = [("sglang_args", k) for k in READ_SGLANG_ARGS]


def _scalars(pair: dict[str, Path]):
    return st.one_of(
        st.none(), st.booleans(), st.integers(-2**40, 2**40), st.sampled_from([0, 1, 2, 3, 4, 8, 16, 17, 65536]),
        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
        st.sampled_from(["auto", "cpu", "cuda", "none", "dflash", "dflash_adaptive", "float32", "org/name",
                         "org/name@main", "./nowhere", str(pair["target"]), str(pair["drafter"]), "1,2", "{}",
                         '{"temperature": 0.5}', "[1, 2]", "torch_native", "flashinfer", "0", "-1", "1e9"]))


def _values(pair: dict[str, Path]):
    return st.recursive(_scalars(pair), lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(["a", "chain_widths", "tree", "x"]), inner,
                                                     max_size=3)), max_leaves=6)


@st.composite
def documents(draw, pair: dict[str, Path]):
    kind = draw(st.sampled_from(["edited"] * 8 + ["not a mapping", "text"]))
    if kind == "text":
        return draw(st.text(alphabet=st.sampled_from(list("model:{}[]- \n\t'\"&*!|>#%@`,?0a")), max_size=40))
    if kind == "not a mapping":
        return yaml.safe_dump(draw(_values(pair)))
    doc = {"model": {"path": str(pair["target"]), "served_name": "tiny"},
           "speculative": {"algorithm": "dflash_adaptive", "draft_model_path": str(pair["drafter"])}}
    if draw(st.booleans()):
        doc["server"] = {"device": draw(st.sampled_from(["cpu", "cuda"]))}
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(draw(st.sampled_from([SCHEMA_PATHS, SGLANG_PATHS]))))
        how = draw(st.sampled_from(["set", "set", "set", "drop", "unknown key"]))
        node = doc
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        if how == "set":  # a scalar half the time, so that more documents get past the schema
            node[path[-1]] = draw(st.one_of(_scalars(pair), _values(pair)))
        elif how == "drop":
            node.pop(path[-1], None)
        else:
            node[draw(st.sampled_from(["typo", "modle", "blocksize", "api_key"]))] = draw(_values(pair))
    return yaml.safe_dump(doc, allow_unicode=True)


def _found(device: str, **sglang_args) -> str:
    """A document the run found raising (ValueError, TypeError from int()), kept as an explicit example."""
    return yaml.safe_dump({"model": {"path": "@TARGET@"}, "server": {"device": device}, "sglang_args": sglang_args,
                           "speculative": {"algorithm": "dflash_adaptive", "draft_model_path": "@DRAFTER@"}})


FOUND = (_found("cuda", cuda_graph_max_bs_decode='{"temperature": 0.5}'), _found("cuda", cuda_graph_max_bs_decode=[1]),
         _found("cuda", tp_size="x"), _found("cuda", mem_fraction_static="x"), _found("cuda", chunked_prefill_size={}),
         _found("cpu", tokenizer_worker_num=2))


def _check(tmp: Path, text: str) -> tuple[int, str]:
    """`dflash-serve check -c <text> --skip-sglang-args` in this process: (exit status, stderr)."""
    path = tmp / "fuzz.yaml"
    path.write_text(text, encoding="utf-8")
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = cli.main(["check", "-c", str(path), "--skip-sglang-args", "--gpu-memory-gib", "80"])
    return rc, err.getvalue()


def example_all(texts):
    def decorate(fn):
        for text in reversed(texts):
            fn = example(text=text)(fn)
        return fn

    return decorate


def test_generated_configs_pass_or_exit_2_with_one_line_naming_the_field(random_pair, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # a Hugging Face id is looked up in an empty cache
    failures: list[str] = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @example_all(FOUND)
    @given(text=documents(random_pair))
    def run(text):
        text = text.replace("@TARGET@", str(random_pair["target"])).replace("@DRAFTER@", str(random_pair["drafter"]))
        try:
            rc, err = _check(tmp_path, text)
        except BaseException as e:  # noqa: BLE001 -- a traceback is what this test is for
            failures.append(f"{type(e).__name__}: {e}\n--- config:\n{text}")
            return
        lines = err.strip().splitlines()
        if rc == 0:
            return
        match = ONE_LINE.match(lines[0]) if len(lines) == 1 else None
        field = match["field"] if match else ""
        named = (field.split(".")[0] in SECTIONS + ("(top level)",) or field.endswith(".yaml")
                 or (re.fullmatch(r"[\w-]+", field) and "unknown key" in lines[0]))  # a top-level key of its own
        if rc != 2 or not named:
            failures.append(f"exit {rc}, stderr {err!r}\n--- config:\n{text}")

    run()
    kinds = {f.split("\n")[0]: f for f in failures}  # one config per kind of failure
    assert not failures, f"{len(failures)} configs not refused with one line:\n" + "\n\n".join(list(kinds.values())[:8])
