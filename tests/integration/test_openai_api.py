"""The OpenAI-compatible API a user relies on, served on CPU through `dflash-serve serve`."""
from __future__ import annotations

import re
import urllib.request

import pytest
from openai import OpenAI

pytestmark = pytest.mark.server


@pytest.fixture(scope="module", params=["plain_server", "dflash_server"])
def server(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_completion(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "def add(a, b):"}],
                                       max_tokens=12, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 0


def test_chat_streaming_with_usage(client):
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=10, temperature=0,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 10


def test_completion_streaming_matches_non_streaming(client):
    kw = dict(model="tiny", prompt="import os\n", max_tokens=16, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)
    assert streamed == full and full


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list()] == ["tiny"]
    with urllib.request.urlopen(f"{server.url}/health", timeout=10) as r:
        assert r.status == 200


def test_metrics_exposes_sglang_families(server, client):
    client.completions.create(model="tiny", prompt="x", max_tokens=4, temperature=0)
    text = server.metrics()
    families = set(re.findall(r"^# TYPE (sglang:\w+)", text, flags=re.M))
    for name in ("sglang:time_to_first_token_seconds", "sglang:e2e_request_latency_seconds",
                 "sglang:num_running_reqs", "sglang:generation_tokens", "sglang:token_usage"):
        assert any(f.startswith(name) for f in families), f"{name} missing from /metrics"
