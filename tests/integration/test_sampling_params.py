"""Every sampling parameter SGLang accepts is served by DFlash exactly as plain decoding serves it, or refused with a
400 naming it (docs/SAMPLING.md). Greedy identity token for token, through real servers:
the plain target, upstream DFLASH (fixed block 16) and DFLASH_ADAPTIVE in cycle mode (every width in turn, so rows
of every position are exercised)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from tests.conftest import PROMPTS, default_config

pytestmark = pytest.mark.server

N_TOKENS = 48
CASES = {
    "repetition_penalty": {"repetition_penalty": 1.3},
    "frequency_penalty": {"frequency_penalty": 1.0},
    "presence_penalty": {"presence_penalty": 1.0},
    "all_penalties": {"repetition_penalty": 1.2, "frequency_penalty": 0.5, "presence_penalty": 0.5},
    # EOS (id 2) pushed up so plain decoding stops within a few tokens unless min_new_tokens holds it off
    "min_new_tokens": {"min_new_tokens": 20, "ignore_eos": False, "logit_bias": {"2": 6.0}},
    "logit_bias": {"logit_bias": {"13": 5.0, "220": -3.0}},
    "bias_and_repetition": {"logit_bias": {"13": 2.0}, "repetition_penalty": 1.3},
    "stop_token_ids": {"stop_token_ids": [13], "ignore_eos": False},
    "stop_strings": {"stop": ["\n\n", "return"], "ignore_eos": False},
    "no_ignore_eos": {"ignore_eos": False},
    "regex": {"regex": "(def|class|for|import) [a-z_]+[(:]", "ignore_eos": False},
    "json_schema": {"json_schema": json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                               "required": ["a"]}), "ignore_eos": False},
    "ebnf": {"ebnf": 'root ::= ("def" | "class" | "for" | "import") " " [a-z_]+ ("(" | ":")', "ignore_eos": False},
    "top_k_1": {"temperature": 1.0, "top_k": 1},  # greedy by another name
}


@pytest.fixture(scope="module")
def cycle_server(module_server_factory, tiny_pair):
    cfg = default_config(tiny_pair, algorithm="dflash_adaptive", draft_model_path=tiny_pair["drafter"],
                         adaptive={"mode": "cycle"})
    return module_server_factory(cfg, "adaptive-cycle")


def generate(server, sampling: dict, prompts=PROMPTS, **extra):
    body = {"text": list(prompts), "sampling_params": {"temperature": 0, "max_new_tokens": N_TOKENS,
                                                       "ignore_eos": True, **sampling}, **extra}
    req = urllib.request.Request(f"{server.url}/generate", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        return json.load(r)


def tokens(out) -> list[list[int]]:
    return [o["output_ids"] for o in out]


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_output_equals_plain_decoding(case, plain_server, dflash_server, cycle_server):
    want = tokens(generate(plain_server, CASES[case]))
    assert any(len(t) > 4 for t in want)
    assert tokens(generate(dflash_server, CASES[case])) == want, "dflash"
    assert tokens(generate(cycle_server, CASES[case])) == want, "dflash_adaptive (cycle)"


def test_penalties_change_the_output_so_the_identity_is_not_vacuous(plain_server):
    base = tokens(generate(plain_server, {}))
    for case in ("repetition_penalty", "frequency_penalty", "presence_penalty"):
        assert tokens(generate(plain_server, CASES[case])) != base, case
    eos_early = tokens(generate(plain_server, {"ignore_eos": False, "logit_bias": {"2": 6.0}}))
    held_off = tokens(generate(plain_server, CASES["min_new_tokens"]))
    assert max(len(t) for t in eos_early) < 20 <= min(len(t) for t in held_off)


@pytest.mark.parametrize("which", ["dflash", "cycle"])
def test_parallel_samples_n_greater_than_one(which, plain_server, dflash_server, cycle_server):
    """n > 1 is SGLang's fan-out into independent requests: greedy copies equal plain decoding's, on upstream's
    block and under dflash_adaptive switching width every step (width 1 included)."""
    server = {"dflash": dflash_server, "cycle": cycle_server}[which]
    want = tokens(generate(plain_server, {"n": 3}, prompts=PROMPTS[:2]))
    assert len(want) == 6
    assert tokens(generate(server, {"n": 3}, prompts=PROMPTS[:2])) == want


LOGPROB_CASES = {"greedy": {}, "repetition_penalty": {"repetition_penalty": 1.2}}


def assert_logprobs_equal_plain(server, plain_server, sampling: dict, prompts=PROMPTS[:3], top: int = 3) -> None:
    """Greedy with logprobs: the tokens, each chosen token's logprob and the top-`top` (ids and logprobs) of every
    position equal plain decoding's (1e-3: the verify's batched logits against a one-token decode's)."""
    extra = {"return_logprob": True, "top_logprobs_num": top}
    want = generate(plain_server, sampling, prompts=prompts, **extra)
    got = generate(server, sampling, prompts=prompts, **extra)
    assert tokens(got) == tokens(want)
    for w, g in zip(want, got):
        w, g = w["meta_info"], g["meta_info"]
        assert len(g["output_token_logprobs"]) == len(w["output_token_logprobs"]) == N_TOKENS
        assert [t[1] for t in g["output_token_logprobs"]] == [t[1] for t in w["output_token_logprobs"]]
        assert [t[0] for t in g["output_token_logprobs"]] == pytest.approx(
            [t[0] for t in w["output_token_logprobs"]], abs=1e-3)
        assert [[t[1] for t in row] for row in g["output_top_logprobs"]] == \
            [[t[1] for t in row] for row in w["output_top_logprobs"]]
        assert [t[0] for row in g["output_top_logprobs"] for t in row] == pytest.approx(
            [t[0] for row in w["output_top_logprobs"] for t in row], abs=1e-3)


@pytest.mark.parametrize("case", sorted(LOGPROB_CASES))
@pytest.mark.parametrize("which", ["dflash", "cycle"])
def test_logprobs_of_the_greedy_continuation_match(which, case, plain_server, dflash_server, cycle_server):
    """Chosen and top-3 logprobs, on upstream's block and under dflash_adaptive switching width every step."""
    server = {"dflash": dflash_server, "cycle": cycle_server}[which]
    assert_logprobs_equal_plain(server, plain_server, LOGPROB_CASES[case])


@pytest.mark.parametrize("sampling, extra, param", [
    ({"temperature": 1.0, "sampling_seed": 7}, {}, "sampling_seed"),
    ({}, {"custom_logit_processor": "{}"}, "custom_logit_processor"),
])
def test_what_dflash_cannot_serve_losslessly_is_refused(dflash_server, plain_server, sampling, extra, param):
    with pytest.raises(urllib.error.HTTPError) as e:
        generate(dflash_server, sampling, prompts=PROMPTS[:1], **extra)
    assert e.value.code == 400
    assert param in json.load(e.value)["error"]["message"]


def test_min_p_never_samples_a_token_min_p_forbids(plain_server, dflash_server, cycle_server, tokenizer):
    """min_p 0.5 at temperature 1: no sampled token below half the most likely token's probability, judged by the
    target's own log-probabilities of the continuation (SGLang's DFlash verify ignored min_p: 505 of 768 forbidden).
    Without min_p the same count is far from 0, so the check has teeth."""
    from tests.sampling_stats import min_p_violations

    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]

    def violations(server, sampling: dict) -> int:
        total = 0
        for ids in prompts * 2:
            out = server.generate(ids, max_new_tokens=N_TOKENS, temperature=1.0, **sampling)["output_ids"]
            total += min_p_violations(plain_server.url, ids, out, 0.5)
        return total

    assert violations(plain_server, {}) > 20  # unfiltered sampling picks such tokens often
    for name, server in (("plain", plain_server), ("dflash", dflash_server), ("adaptive", cycle_server)):
        assert violations(server, {"min_p": 0.5}) == 0, name


@pytest.mark.parametrize("which", ["dflash", "cycle"])
def test_stops_inside_a_commit_equal_plain_decoding(which, plain_server, dflash_server, cycle_server, tokenizer):
    """Stop strings, stop token ids, EOS, min_new_tokens, max_new_tokens 1..17 and a grammar's end landing inside
    a step's commit (tests/stops.py): tokens and finish reason equal plain decoding's, on upstream's block 16 and
    on every chain width in turn, width 1 included."""
    from tests.stops import assert_stops_equal_plain

    server = {"dflash": dflash_server, "cycle": cycle_server}[which]
    assert_stops_equal_plain(server, plain_server, [tokenizer(p)["input_ids"] for p in PROMPTS], tokenizer)
