"""Per-request verify widths (speculative.adaptive.per_request_widths): a ragged step -- each request drafting and
verifying its own width in one draft and one verify forward -- commits exactly what plain decoding would, greedy,
and samples from the target's distribution at temperature 1, with top-k/top-p, with min_p and with penalties;
penalties and logit_bias adjust every verified row as plain decoding would, and logprobs are plain decoding's.

The cycle server gives request i of every step the pattern's entry i steps ahead, so one batch mixes widths 1, 2,
4, 8 and 16 (speculation off next to the full block) and each request's width changes every step.
"""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness.server import http_json
from tests.integration.test_adaptive import adaptive_config, scrape
from tests.integration.test_lossless import MAX_NEW, plain_greedy, prompt_ids  # noqa: F401  (shared fixtures)
from tests.integration.test_sampling_distribution import CONFIGS, assert_same_distribution, plain_sample, sample

pytestmark = pytest.mark.server
PATTERN = [16, 1, 4, 16, 8, 2, 1]


@pytest.fixture(scope="module")
def ragged_cycle_server(module_server_factory, tiny_pair):
    cfg = adaptive_config(tiny_pair, mode="cycle", candidates=[1, 2, 4, 8, 16], cycle_pattern=PATTERN,
                          per_request_widths=True)
    return module_server_factory(cfg, "ragged-cycle")


def _ragged_steps(server) -> float:
    return sum(scrape(server, "dflash_ragged_steps_total").values())


def test_ragged_steps_commit_what_plain_decoding_commits(ragged_cycle_server, plain_greedy, prompt_ids):
    before = _ragged_steps(ragged_cycle_server)
    batched = ragged_cycle_server.generate(prompt_ids, max_new_tokens=MAX_NEW, temperature=0)
    assert [r["output_ids"] for r in batched] == plain_greedy
    ragged = _ragged_steps(ragged_cycle_server) - before
    assert ragged >= 10, ragged  # the batch really ran ragged steps (a lone request runs batch-wide)
    counted = scrape(ragged_cycle_server, "dflash_ragged_request_steps_total")
    widths = {int(re.search(r'block_size="(\d+)"', labels).group(1)) for labels, n in counted.items() if n > 0}
    assert widths == set(PATTERN), counted  # speculation off next to the full block, in the same steps
    # drafts were accepted inside the ragged steps (committing one token a request would pass trivially)
    assert max(r["meta_info"]["spec_accept_length"] for r in batched) > 1.5


def test_greedy_ragged_steps_with_logit_bias_commit_what_plain_decoding_commits(ragged_cycle_server, plain_server,
                                                                                prompt_ids):
    """logit_bias is applied to every verified row of a ragged step before its argmax, as plain decoding applies it
    before its own (a batch with it verifies the logits, not upstream's skipped argmax)."""
    bias = {"13": 5.0, "220": -3.0}
    want = [r["output_ids"] for r in plain_server.generate(prompt_ids, max_new_tokens=MAX_NEW, temperature=0,
                                                           logit_bias=bias)]
    assert want != [r["output_ids"] for r in plain_server.generate(
        prompt_ids, max_new_tokens=MAX_NEW, temperature=0)]  # the bias changes the output: not vacuous
    before = _ragged_steps(ragged_cycle_server)
    got = ragged_cycle_server.generate(prompt_ids, max_new_tokens=MAX_NEW, temperature=0, logit_bias=bias)
    assert [r["output_ids"] for r in got] == want
    assert _ragged_steps(ragged_cycle_server) - before >= 10


@pytest.mark.parametrize("config", ["temperature", "top_k_top_p", "min_p", "penalties"])
def test_sampled_ragged_steps_keep_the_target_distribution(config, ragged_cycle_server, plain_server):
    """A sampled batch runs ragged steps too (every step mixes widths 1 to 16) and its outputs have the target's
    distribution: the joint of the first three tokens against plain decoding's, with the statistic, sample size and
    significance of test_sampling_distribution.py (whose power is computed against a bonus drawn from the wrong row
    and a resample that keeps the rejected token)."""
    before = _ragged_steps(ragged_cycle_server)
    spec = sample(ragged_cycle_server, CONFIGS[config])
    assert _ragged_steps(ragged_cycle_server) - before >= 2  # the 800 requests' three tokens: ragged steps
    assert_same_distribution(f"ragged, {config}", plain_sample(plain_server, config), spec)


PENALTIES = {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.5, "min_new_tokens": 12}


def _batch(server, prompt_ids, sampling: dict, **extra) -> list[dict]:
    body = {"input_ids": prompt_ids, **extra,
            "sampling_params": {"ignore_eos": True, "max_new_tokens": MAX_NEW, "temperature": 0, **sampling}}
    return http_json(f"{server.url}/generate", body)


def test_greedy_ragged_steps_with_penalties_commit_what_plain_decoding_commits(ragged_cycle_server, plain_server,
                                                                               plain_greedy, prompt_ids):
    """Row j of a request verifying b positions is penalised as plain decoding penalises the token after its
    anchor and first j drafts (verify_rows.py, replayed on the padded layout): frequency, presence, repetition and
    min_new_tokens at once, in a batch whose every step mixes widths 1 to 16."""
    want = [r["output_ids"] for r in _batch(plain_server, prompt_ids, PENALTIES)]
    assert want != plain_greedy  # the penalties change the output: not vacuous
    before = _ragged_steps(ragged_cycle_server)
    got = _batch(ragged_cycle_server, prompt_ids, PENALTIES)
    assert [r["output_ids"] for r in got] == want
    assert _ragged_steps(ragged_cycle_server) - before >= 10


def test_ragged_steps_report_plain_decodings_logprobs(ragged_cycle_server, plain_server, prompt_ids):
    """Logprobs of the committed tokens and the top alternatives, from each request's own verified rows."""
    extra = {"return_logprob": True, "top_logprobs_num": 3}
    want = _batch(plain_server, prompt_ids, {"repetition_penalty": 1.2}, **extra)
    before = _ragged_steps(ragged_cycle_server)
    got = _batch(ragged_cycle_server, prompt_ids, {"repetition_penalty": 1.2}, **extra)
    assert _ragged_steps(ragged_cycle_server) - before >= 10
    for w, g in zip(want, got):
        assert g["output_ids"] == w["output_ids"]
        for key in ("output_token_logprobs", "output_top_logprobs"):
            lw, lg = w["meta_info"][key], g["meta_info"][key]
            assert len(lg) == len(lw) == MAX_NEW
            flat = (lambda rows: [t[0] for t in rows]) if key == "output_token_logprobs" else (
                lambda rows: [t[0] for top in rows for t in top])
            assert flat(lg) == pytest.approx(flat(lw), abs=1e-3), key


def test_requests_leaving_a_ragged_batch_stay_exact(ragged_cycle_server, plain_server, prompt_ids):
    """Concurrent requests of different lengths finish at different steps: the ragged batch shrinks (and its
    KV slots are reused) while the others run on."""
    lengths = [8 + 9 * i for i in range(len(prompt_ids))]

    def run(server):
        with ThreadPoolExecutor(len(prompt_ids)) as pool:
            return list(pool.map(lambda a: server.generate(a[0], max_new_tokens=a[1], temperature=0)["output_ids"],
                                 zip(prompt_ids, lengths)))

    before = _ragged_steps(ragged_cycle_server)
    assert run(ragged_cycle_server) == run(plain_server)
    assert _ragged_steps(ragged_cycle_server) > before


def test_stops_inside_ragged_commits_equal_plain_decoding(ragged_cycle_server, plain_server, prompt_ids, tokenizer):
    """Each row of a batch stopping at its own place (tests/stops.py: a stop token, a stop string, EOS,
    min_new_tokens, max_new_tokens 1..17, a grammar's end) inside ragged steps, where every row verifies its own
    width: tokens and finish reason equal plain decoding's."""
    from tests.stops import assert_stops_equal_plain

    before = _ragged_steps(ragged_cycle_server)
    assert_stops_equal_plain(ragged_cycle_server, plain_server, prompt_ids, tokenizer)
    assert _ragged_steps(ragged_cycle_server) - before > 0, "no ragged step ran"
