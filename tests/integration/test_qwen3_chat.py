"""Qwen3 as users run it, on CPU with the tiny pair: SGLang's reasoning parser (`qwen3`) and tool-call parser
(`qwen25`) on, and a chat template with Qwen3's thinking switch (`enable_thinking`, per request through
chat_template_kwargs or as the server's default through `default_chat_template_kwargs`). The parsers read the text
after decoding, so greedy output -- the message content and the reasoning content -- is the same served by
dflash_adaptive as by plain decoding, with thinking on and off."""
from __future__ import annotations

import pytest

from harness.server import http_json
from tests.conftest import default_config

pytestmark = pytest.mark.server
MAX_NEW = 48

# Qwen3's switch, as its own template writes it: thinking off closes an empty think block before the answer.
TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}")
QWEN3_ARGS = {"reasoning_parser": "qwen3", "tool_call_parser": "qwen25"}
QUESTIONS = ["def fib(n):", "Write a loop that prints the numbers 0 to 9.", "import os\nimport sys\n"]


@pytest.fixture(scope="module")
def servers(module_server_factory, tiny_pair, tmp_path_factory):
    template = tmp_path_factory.mktemp("qwen3") / "chat_template.jinja"
    template.write_text(TEMPLATE)
    out = {}
    for name, spec in (("plain", {"algorithm": "none"}),
                       ("adaptive", {"algorithm": "dflash_adaptive", "draft_model_path": tiny_pair["drafter"]})):
        cfg = default_config(tiny_pair, **spec)
        cfg["sglang_args"] = {**cfg.get("sglang_args", {}), **QWEN3_ARGS, "chat_template": str(template),
                              "default_chat_template_kwargs": {"enable_thinking": False}}
        out[name] = module_server_factory(cfg, f"qwen3-{name}")
    return out


def _chat(server, question: str, **extra) -> dict:
    body = {"model": "tiny", "messages": [{"role": "user", "content": question}], "max_tokens": MAX_NEW,
            "temperature": 0, **extra}
    r = http_json(f"{server.url}/v1/chat/completions", body)
    return {"message": {k: r["choices"][0]["message"].get(k) for k in ("content", "reasoning_content")},
            "prompt_tokens": r["usage"]["prompt_tokens"], "completion_tokens": r["usage"]["completion_tokens"]}


def test_thinking_switch_and_parsers_leave_greedy_output_unchanged(servers):
    for question in QUESTIONS:
        plain_off = _chat(servers["plain"], question)  # the server's default: thinking off
        plain_on = _chat(servers["plain"], question, chat_template_kwargs={"enable_thinking": True})
        # the switch reaches the template: thinking off renders the closed think block into the prompt
        assert plain_off["prompt_tokens"] > plain_on["prompt_tokens"]
        assert plain_off == _chat(servers["plain"], question, chat_template_kwargs={"enable_thinking": False})
        for kwargs, expected in (({}, plain_off), ({"chat_template_kwargs": {"enable_thinking": True}}, plain_on)):
            got = _chat(servers["adaptive"], question, **kwargs)
            assert got == expected, (question, kwargs)
        # the reasoning parser at work: thinking on, the answer so far is reasoning (no </think> yet in 48 tokens
        # of the tiny model); thinking off, it is the message's content
        assert plain_on["message"]["reasoning_content"] and not plain_on["message"]["content"]
        assert plain_off["message"]["content"] and plain_off["message"]["reasoning_content"] is None
