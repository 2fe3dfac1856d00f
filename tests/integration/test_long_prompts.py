"""Prompts longer than the prefill chunk, and decoding to the context limit, on chain, tree and ragged steps.

Every other test prompt fits one prefill chunk, yet the drafter's context is built from the prefill's hidden states,
chunk by chunk; and a tree's window reserves more past the committed length than a chain's. Each server here runs
chunked prefill of 64 and a 512-token context, plain decoding too (tests/long_prompts.py has the checks)."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from harness.server import ManagedServer, side_by_side
from tests.conftest import default_config
from tests.integration.test_adaptive import adaptive_config
from tests.integration.test_per_request_widths import PATTERN
from tests.integration.test_tree import SWITCHES
from tests.long_prompts import assert_long_prompts_equal_plain, with_long_prompt_limits

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def servers(tiny_pair, tmp_path_factory):
    """Plain decoding; a chain width per step in turn (1..16); a tree of 40 prefixes between chains; a width per
    request in turn (ragged steps) -- all with the long-prompt limits, started side by side."""
    workdir = tmp_path_factory.mktemp("long-prompts")
    configs = {
        "plain": default_config(tiny_pair, algorithm="none"),
        "chains": adaptive_config(tiny_pair, mode="cycle"),
        "trees": adaptive_config(tiny_pair, mode="cycle", candidates=[1, 4, 8, 16, 41], cycle_pattern=SWITCHES),
        "ragged": adaptive_config(tiny_pair, mode="cycle", candidates=[1, 2, 4, 8, 16], cycle_pattern=PATTERN,
                                  per_request_widths=True),
    }
    made = {name: ManagedServer(with_long_prompt_limits(cfg), workdir, name) for name, cfg in configs.items()}
    with side_by_side(made):
        yield made


@pytest.fixture(scope="module")
def tokenizer(tiny_pair):
    return AutoTokenizer.from_pretrained(str(tiny_pair["target"]))


@pytest.mark.parametrize("kind", ["chains", "trees", "ragged"])
def test_long_prompts_and_the_context_limit_equal_plain_decoding(servers, tokenizer, kind):
    assert_long_prompts_equal_plain(servers[kind], servers["plain"], tokenizer)
