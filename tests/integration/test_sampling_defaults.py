"""Sampling refusals judge the parameters a request is served with: the operator's defaults
(`sglang_args.preferred_sampling_params`) merged under the request's own, as SGLang merges them. A default DFlash
cannot serve at all is refused at start-up (tests/unit/test_config_errors.py); this one is lossless until a request
samples: a seed, for greedy decoding."""
from __future__ import annotations

import json
import urllib.error

import pytest

from harness.server import ManagedServer, http_json
from tests.conftest import default_config

pytestmark = pytest.mark.server

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def seeded_default(tiny_pair, tmp_path_factory):
    cfg = default_config(tiny_pair)
    cfg["sglang_args"]["preferred_sampling_params"] = json.dumps({"sampling_seed": 7, "temperature": 0})
    with ManagedServer(cfg, tmp_path_factory.mktemp("seeded-default"), "seeded-default") as s:
        yield s


def test_a_request_that_samples_under_the_operators_seed_is_refused(seeded_default):
    """The request sends no seed; the operator's default gives it one, and DFlash's own coins would not reproduce
    the seeded samples: refused, naming the parameter."""
    with pytest.raises(urllib.error.HTTPError) as e:
        http_json(f"{seeded_default.url}/generate",
                  {"text": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 1.0}})
    assert e.value.code == 400
    assert "sampling_seed" in json.load(e.value)["error"]["message"]


def test_greedy_requests_under_the_operators_seed_are_served(seeded_default, plain_server):
    """The request leaves temperature to the operator's default (0): served greedy, as plain decoding serves it --
    the same tokens and finish, not merely some tokens (a server that checked the merged parameters but sampled
    without them would still answer)."""
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 24}}
    want = http_json(f"{plain_server.url}/generate", body | {"sampling_params": {"max_new_tokens": 24,
                                                                                 "temperature": 0}})
    out = http_json(f"{seeded_default.url}/generate", body)
    assert out["meta_info"]["completion_tokens"] == len(want["output_ids"]) > 4
    assert out["output_ids"] == want["output_ids"]
    assert out["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
