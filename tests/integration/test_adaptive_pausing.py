"""Speculation off and on again (DFLASH_ADAPTIVE at width 1, then drafting): greedy output equals plain decoding
across every transition, and the deferred draft-KV append leaves acceptance exactly as per-step appends do.

Its own module so its two servers stop when it ends (a server costs ~3 GB; CI's 24 GB holds about seven)."""
from __future__ import annotations

import pytest

from tests.integration.test_adaptive import adaptive_config
from tests.integration.test_lossless import (  # noqa: F401  (prompt_ids, plain_greedy: shared fixtures)
    MAX_NEW, plain_greedy, prompt_ids)

pytestmark = pytest.mark.server

# drafting pauses (width 1, no draft) for 1, 4 and 20 steps, then resumes at 16: every pause's deferred appends
# (and the prompt contexts of requests that start in one) are flushed when drafting resumes, or written when a
# request finishes mid-pause (the prefix cache may hand its KV on); the byte bound is tests/unit/test_draft_kv.py's
PAUSES = [1, 16] + [1] * 4 + [16] + [1] * 20 + [16, 16]


@pytest.fixture(scope="module")
def pausing_servers(module_server_factory, tiny_pair):
    """(deferred, deferred without a prefix cache, eager): the same pausing cycle, width-1 draft-KV appends
    deferred (the product; without a prefix cache, the path where a request that leaves with rows pending has them
    left out of the next flush) or written every step (the reference, names.EAGER_APPEND). The
    cycle position is the server's step count: every test sends all of them the same requests in the same order,
    so they stay in step."""
    cfg = adaptive_config(tiny_pair, mode="cycle", candidates=[1, 16], cycle_pattern=PAUSES)
    no_cache = {**cfg, "sglang_args": {**cfg.get("sglang_args", {}), "disable_radix_cache": True}}
    return (module_server_factory(cfg, "adaptive-pausing"),
            module_server_factory(no_cache, "adaptive-pausing-no-prefix-cache"),
            module_server_factory(cfg, "adaptive-pausing-eager", env={"DFLASH_SERVE_EAGER_DRAFT_APPEND": "1"}))


def test_greedy_equals_plain_across_speculation_off_on_transitions(pausing_servers, plain_greedy, prompt_ids):
    for server in pausing_servers:
        single = [server.generate(ids, max_new_tokens=MAX_NEW, temperature=0) for ids in prompt_ids]
        assert [r["output_ids"] for r in single] == plain_greedy, server.log_path.name
        batched = server.generate(prompt_ids, max_new_tokens=MAX_NEW, temperature=0)
        assert [r["output_ids"] for r in batched] == plain_greedy, server.log_path.name


def test_acceptance_after_resuming_equals_acceptance_never_paused(pausing_servers, prompt_ids):
    """Deferred appends leave the draft KV exactly as per-step appends do: every request accepts the same drafts
    at the same steps on both servers (same greedy outputs, same deterministic width sequence)."""
    seen = []
    for server in pausing_servers:
        out = [server.generate(ids, max_new_tokens=MAX_NEW, temperature=0) for ids in prompt_ids]
        out.append(server.generate(prompt_ids, max_new_tokens=MAX_NEW, temperature=0))  # a batch too
        seen.append([(r["output_ids"], r["meta_info"]["spec_verify_ct"], r["meta_info"]["spec_num_correct_drafts"])
                     for r in (out[:-1] + out[-1])])
    assert seen[0] == seen[2] and seen[1] == seen[2]
    assert sum(c for _, _, c in seen[0]) > len(seen[0]) * 4, "few drafts accepted: resumption barely exercised"


def test_a_request_on_the_prefix_of_one_that_never_drafted_is_served_as_with_per_step_appends(pausing_servers,
                                                                                              prompt_ids):
    """A request that finished inside a pause left its prompt context and every row deferred (parked with the
    prefix cache, dropped without one); the next request on its prompt takes those slots from the cache and drafts:
    the same output, drafts and accepts as where every row was written at once. (Which rows a flush writes is
    tests/unit/test_draft_kv.py's: this pair's drafts do not tell a missing early context apart.)"""
    from tests.integration.test_adaptive import scrape

    stretch = PAUSES.index(1, PAUSES.index(16, 2))  # the first step of the long pause
    fresh = prompt_ids[0][:1] + prompt_ids[1]  # a prompt no earlier test sent: no prefix of it is cached yet
    seen = []
    for server in pausing_servers:
        while int(sum(scrape(server, "dflash_block_size_steps_total").values())) % len(PAUSES) != stretch:
            server.generate(prompt_ids[0][:4], max_new_tokens=2, temperature=0)  # one decode step
        first = server.generate(fresh, max_new_tokens=8, temperature=0)  # seven steps, all in the pause
        again = server.generate(fresh, max_new_tokens=MAX_NEW, temperature=0)  # drafts after the pause
        seen.append([(r["output_ids"], r["meta_info"]["spec_verify_ct"], r["meta_info"]["spec_num_correct_drafts"],
                      r["meta_info"].get("cached_tokens")) for r in (first, again)])
    assert seen[0][1][3] > 0, "the second request did not reuse the first one's prefix"
    assert seen[0][0][2] == 0 and seen[0][1][2] > 4, "the first request drafted, or the second barely did"
    assert [s[:3] for s in seen[0]] == [s[:3] for s in seen[2]]
    assert [s[:3] for s in seen[1]] == [s[:3] for s in seen[2]]
