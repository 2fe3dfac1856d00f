"""DDTree tree verification (a candidate width above the drafter's block) through real CPU servers: greedy output
equals plain decoding at every width and across chain/tree/width-1 transitions and under the adaptive shape,
sampling keeps the target's distribution, the KV a tree step leaves is the KV plain decoding would have written,
and the metrics show the trees at work.

Its own module so its servers stop when it ends (a server costs ~3 GB)."""
from __future__ import annotations

import pytest

from harness.server import http_json
from tests.conftest import PROMPTS
from tests.integration.test_adaptive import adaptive_config, by_label, delta, scrape
from tests.integration.test_lossless import (  # noqa: F401  (prompt_ids, plain_greedy: shared fixtures)
    MAX_NEW, SAMPLING, SAMPLING_IDS, assert_sampling_lossless, plain_greedy, prompt_ids)

pytestmark = pytest.mark.server
# tree steps (width 41: 40 prefixes), chain steps at 4, 8 and 16 and speculation off (width 1, deferred draft-KV
# appends) in one cycle
SWITCHES = [41, 1, 1, 41, 4, 16, 41, 1, 8, 16, 41]


@pytest.fixture(scope="module")
def tree_server(module_server_factory, tiny_pair):
    """Every step a tree of 31 draft prefixes (width 32: a 32-slot window, the decode reserve widened for it)."""
    return module_server_factory(adaptive_config(tiny_pair, mode="fixed", candidates=[16, 32], fixed_block=32),
                                 "tree31")


@pytest.fixture(scope="module")
def switching_tree_server(module_server_factory, tiny_pair):
    """One width per step: a tree of 40 prefixes, chains of 4, 8 and 16, speculation off at 1."""
    cfg = adaptive_config(tiny_pair, mode="cycle", candidates=[1, 4, 8, 16, 41], cycle_pattern=SWITCHES)
    return module_server_factory(cfg, "tree40-cycle")


@pytest.fixture(scope="module")
def adaptive_shape_server(module_server_factory, tiny_pair):
    """The controller picks the shape every step: chains of 1..16 or trees of 31 and 63 (cpu-tree.yaml's)."""
    cfg = adaptive_config(tiny_pair, candidates=[1, 2, 4, 8, 16, 32, 64])
    return module_server_factory(cfg, "adaptive-shape")


def test_tree_greedy_equals_plain(tree_server, switching_tree_server, adaptive_shape_server, plain_greedy, prompt_ids):
    """Output equals plain decoding's token for token; under the adaptive shape the controller's exploration of
    never-measured widths runs trees too (the cost seed is a modelled roofline)."""
    for server in (tree_server, switching_tree_server, adaptive_shape_server):
        before = scrape(server, "dflash_tree_steps_total")
        single = [server.generate(ids, max_new_tokens=MAX_NEW, temperature=0) for ids in prompt_ids]
        assert [r["output_ids"] for r in single] == plain_greedy, server.log_path.name
        batched = server.generate(prompt_ids, max_new_tokens=MAX_NEW, temperature=0)
        assert [r["output_ids"] for r in batched] == plain_greedy, server.log_path.name
        assert sum(delta(scrape(server, "dflash_tree_steps_total"), before).values()) > 0, "no tree step ran"


def test_tree_commits_more_per_step_than_the_chain_it_replaces(tree_server, dflash_server, prompt_ids):
    """Same drafter forward: the best 31 prefixes commit more tokens per step than upstream DFlash's greedy chain
    of 16 on the code prompts (deterministic: greedy, fixed prompts). A tree whose path KV or draft context were
    misplaced would accept far less."""
    tree = [tree_server.generate(ids, max_new_tokens=MAX_NEW, temperature=0) for ids in prompt_ids]
    chain = [dflash_server.generate(ids, max_new_tokens=MAX_NEW, temperature=0) for ids in prompt_ids]
    per_step = [r["meta_info"]["spec_accept_length"] for r in tree]
    chain_per_step = [r["meta_info"]["spec_accept_length"] for r in chain]
    assert sum(per_step) > sum(chain_per_step), (per_step, chain_per_step)
    extra = by_label(scrape(tree_server, "dflash_tree_extra_tokens_total"), "budget")
    assert extra.get("31", 0) > 0, "no tree step committed past the greedy chain's agreement"


def test_kv_after_tree_steps_is_plain_decodings(tree_server, plain_server, plain_greedy, prompt_ids):
    """The committed path's KV sits at the committed positions: a new request that extends a finished one reuses its
    cached KV (the radix cache holds prompt + output as tree steps left them) and continues exactly as plain
    decoding does from the same text."""
    for ids, out in zip(prompt_ids[:3], plain_greedy[:3]):
        tree_server.generate(ids, max_new_tokens=MAX_NEW, temperature=0)  # leaves prompt + output in the cache
        follow = ids + out[: MAX_NEW - 4]
        r = tree_server.generate(follow, max_new_tokens=24, temperature=0)
        assert r["meta_info"]["cached_tokens"] > len(ids), "the continuation did not reuse the tree steps' KV"
        assert r["output_ids"] == plain_server.generate(follow, max_new_tokens=24, temperature=0)["output_ids"]


@pytest.mark.parametrize("sampling", SAMPLING, ids=SAMPLING_IDS)
def test_tree_sampling_is_lossless(tree_server, plain_server, tokenizer, sampling):
    """The chain's test (test_lossless.py: alpha 1e-3 per position, false-failure rate <= 2e-3 per run) on trees."""
    assert_sampling_lossless(tree_server, plain_server, tokenizer, sampling)


def test_requests_a_tree_cannot_serve_verify_the_chain(tree_server, plain_greedy, prompt_ids):
    """Logprobs are reported per chain row: the controller decides such a batch without trees -- chain 16 in the
    fixed tree's place -- with the same output."""
    before = by_label(scrape(tree_server, "dflash_block_size_steps_total"), "block_size")
    trees_before = scrape(tree_server, "dflash_tree_steps_total")
    body = {"input_ids": prompt_ids[0], "return_logprob": True,
            "sampling_params": {"ignore_eos": True, "max_new_tokens": MAX_NEW, "temperature": 0}}
    r = http_json(f"{tree_server.url}/generate", body)
    assert r["output_ids"] == plain_greedy[0]
    assert len(r["meta_info"]["output_token_logprobs"]) == MAX_NEW
    steps = delta(by_label(scrape(tree_server, "dflash_block_size_steps_total"), "block_size"), before)
    assert steps.get("16", 0) > 0
    assert sum(delta(scrape(tree_server, "dflash_tree_steps_total"), trees_before).values()) == 0


def test_stops_inside_a_tree_commit_equal_plain_decoding(tree_server, plain_server, prompt_ids, tokenizer):
    """Stop strings, stop token ids, EOS, max_new_tokens 1..17 landing inside a tree step's committed path, and
    min_new_tokens and a grammar's end on the chain such requests verify (tests/stops.py): tokens and finish
    reason equal plain decoding's."""
    from tests.stops import assert_stops_equal_plain

    before = scrape(tree_server, "dflash_tree_steps_total")
    assert_stops_equal_plain(tree_server, plain_server, prompt_ids, tokenizer)
    assert sum(delta(scrape(tree_server, "dflash_tree_steps_total"), before).values()) > 0, "no tree step ran"


@pytest.mark.parametrize("which", ["tree", "switching"])
def test_logprobs_and_parallel_samples_under_trees_equal_plain(which, tree_server, switching_tree_server,
                                                              plain_server):
    """The default's API surface where trees run: chosen and top-3 logprobs (such a batch verifies chains) and n > 1
    (greedy copies, trees allowed) equal plain decoding's, on the fixed tree and switching tree/chain/width 1."""
    from tests.integration.test_sampling_params import assert_logprobs_equal_plain, generate, tokens

    server = {"tree": tree_server, "switching": switching_tree_server}[which]
    assert_logprobs_equal_plain(server, plain_server, {})
    before = scrape(server, "dflash_tree_steps_total")
    want = tokens(generate(plain_server, {"n": 3}, prompts=PROMPTS[:2]))
    assert tokens(generate(server, {"n": 3}, prompts=PROMPTS[:2])) == want
    assert sum(delta(scrape(server, "dflash_tree_steps_total"), before).values()) > 0, "no tree step ran"
