"""Qwen3's thinking and tool calls through the config: SGLang's own flags in `sglang_args`, checked by its parser
(a JSON-valued one written as a YAML mapping), and in every GPU config. Served on CPU:
tests/integration/test_qwen3_chat.py."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from service.sglang_args import to_argv

REPO = Path(__file__).resolve().parents[2]
QWEN3 = {"reasoning_parser": "qwen3", "tool_call_parser": "qwen25"}


def test_a_mapping_value_reaches_sglang_as_json():
    argv = to_argv({"default_chat_template_kwargs": {"enable_thinking": False}})
    assert argv == ["--default-chat-template-kwargs", '{"enable_thinking": false}']
    assert json.loads(argv[1]) == {"enable_thinking": False}


def test_every_gpu_config_runs_qwen3_with_its_parsers():
    configs = [*sorted((REPO / "deploy" / "configs").glob("gpu-*.yaml")),
               *sorted((REPO / "deploy" / "k8s").rglob("config.yaml"))]
    assert len(configs) >= 4
    for path in configs:
        args = yaml.safe_load(path.read_text())["sglang_args"]
        assert {k: args.get(k) for k in QWEN3} == QWEN3, path


def test_sglangs_parser_takes_the_qwen3_flags_and_refuses_a_wrong_one():
    pytest.importorskip("sglang", reason="sglang not installed (scripts/install-cpu.sh)")
    code = ("import json, sys\nfrom service.config import ConfigError\nfrom service.sglang_args import "
            "validate_passthrough\nvalidate_passthrough(json.loads(sys.argv[1]))\ntry:\n"
            "    validate_passthrough({'reasoning_parser': 'qwen4'})\nexcept ConfigError as e:\n    print(e)\n")
    good = {**QWEN3, "default_chat_template_kwargs": {"enable_thinking": False}}
    r = subprocess.run([sys.executable, "-c", code, json.dumps(good)], capture_output=True, text=True, cwd=REPO,
                       timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("sglang_args.reasoning_parser: invalid value 'qwen4'"), r.stdout
