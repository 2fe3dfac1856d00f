"""Where requests stop, inside a speculative step's commit: the tokens and finish reason a speculative server returns
equal plain decoding's for every way a request ends (tests/integration: chain, width 1, tree, ragged and hybrid).

A step commits several tokens at once; the request may end at any of them. Upstream checks each committed token
(Req.update_finish_state) and cuts the output there; the speculative rows must have applied what plain decoding
applies before that token (logit_bias pushing EOS up, the min_new_tokens EOS ban, the grammar's mask), and nothing
past the stop may leak out. Each case is built from plain decoding's own greedy continuation of each prompt, so the
stop falls a few tokens into the output, where the drafter's block is accepting:
  * max_new_tokens 1..17 (one per row, all of them over three batches): the length cut inside a block of 16;
  * a stop token id: the token plain decoding emits at a row's own position (3..13), first seen there;
  * a stop string: the text of two tokens at such a position, not in the text before it;
  * EOS pushed up by logit_bias (plain decoding ends within a few tokens), and the same with min_new_tokens
    holding it off until a row's own count (EOS is the first token it lets through);
  * a grammar (regex, EBNF) whose end the output reaches within a few tokens.
The trained drafter never proposes EOS (no training text ends in it), so an EOS lands where the target corrects the
draft: at the end of its step's commit, after the accepted drafts; the stop token id is the same per-token check
(SGLang tests EOS and stop ids in one loop) landing among accepted drafts.
"""
from __future__ import annotations

import json
import urllib.request

REF_TOKENS = 32
MAX_NEW = 24  # enough for every stop below to land; a stop case that runs out ends on length in both
GRAMMARS = {
    "regex": {"regex": "(def|class|for|import) [a-z_]+[(:]"},
    "ebnf": {"ebnf": 'root ::= ("def" | "class" | "for" | "import") " " [a-z_]+ ("(" | ":")'},
}


def _generate(server, prompt_ids: list[list[int]], params: list[dict], extra: dict | None = None) -> list[dict]:
    body = {"input_ids": prompt_ids, "sampling_params": params, **(extra or {})}
    req = urllib.request.Request(f"{server.url}/generate", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        return json.load(r)


LAST_STOP = 16  # a stop lands at most here: well inside MAX_NEW


def _first_seen_at(ref: list[int], lo: int) -> int:
    """A position in 1..LAST_STOP whose token is not among the tokens before it (the stop lands there, not
    earlier): the first at or after `lo`, else the last before it."""
    new = [p for p in range(1, LAST_STOP + 1) if ref[p] not in ref[:p]]
    assert new, f"no new token in the first {LAST_STOP} of {ref}"
    return next((p for p in new if p >= lo), new[-1])


def _new_text_at(ref: list[int], p: int, tokenizer) -> str:
    """The text of two tokens from position q >= p (the first such q up to LAST_STOP, else back from p) that is not
    blank and not in the text before it: a stop string plain decoding first completes there."""
    for q in [*range(p, LAST_STOP + 1), *range(p - 1, 0, -1)]:
        text = tokenizer.decode(ref[q:q + 2])
        if text.strip() and text not in tokenizer.decode(ref[:q + 1]):
            return text
    raise AssertionError(f"no new two-token text in the first {LAST_STOP} tokens of {ref}")


def stop_cases(plain_server, prompt_ids: list[list[int]], tokenizer) -> dict[str, list[dict]]:
    """Case name -> one request's sampling parameters per prompt (greedy), from plain decoding's continuations."""
    base = {"temperature": 0, "max_new_tokens": MAX_NEW}
    refs = [r["output_ids"] for r in _generate(plain_server, prompt_ids,
                                               [{"temperature": 0, "max_new_tokens": REF_TOKENS, "ignore_eos": True}]
                                               * len(prompt_ids))]
    n = len(prompt_ids)
    cases: dict[str, list[dict]] = {}
    for batch in range(0, 17, n):  # max_new_tokens 1..17, each on some row
        cases[f"max_new_tokens_{batch + 1}"] = [
            {**base, "ignore_eos": True, "max_new_tokens": min(17, batch + i + 1)} for i in range(n)]
    ids, strs = [], []
    for i, ref in enumerate(refs):
        p = _first_seen_at(ref, 3 + (2 * i) % 11)
        ids.append({**base, "stop_token_ids": [ref[p]]})
        strs.append({**base, "stop": [_new_text_at(ref, p, tokenizer)]})
    cases["stop_token_ids"], cases["stop_strings"] = ids, strs
    eos = {"logit_bias": {str(tokenizer.eos_token_id): 6.0}}
    cases["eos"] = [{**base, **eos}] * n
    cases["min_new_tokens"] = [{**base, **eos, "min_new_tokens": 4 + (3 * i) % 9} for i in range(n)]
    for name, grammar in GRAMMARS.items():
        cases[f"grammar_{name}"] = [{**base, **grammar}] * n
    return cases


_PLAIN: dict[tuple, list[dict]] = {}


def plain_outputs(plain_server, prompt_ids: list[list[int]], cases: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """Plain decoding's outputs for every case, once per session and prompt set (modules share the plain server)."""
    key = (plain_server.url, json.dumps(prompt_ids), json.dumps(cases, sort_keys=True))
    if key not in _PLAIN:
        _PLAIN[key] = {name: _generate(plain_server, prompt_ids, params) for name, params in cases.items()}
    return _PLAIN[key]


def summary(out: dict) -> tuple:
    return out["output_ids"], out["meta_info"]["finish_reason"]


def stop_mismatches(server, prompt_ids: list[list[int]], cases: dict[str, list[dict]],
                    want: dict[str, list[dict]]) -> list[str]:
    """Every case on `server` against plain decoding's outputs `want`: the rows whose tokens or finish reason differ
    (empty: none)."""
    bad = []
    for name, params in cases.items():
        got = _generate(server, prompt_ids, params)
        for row, (w, g) in enumerate(zip(want[name], got)):
            if summary(w) != summary(g):
                bad.append(f"{name} row {row}: plain {summary(w)}, speculative {summary(g)}")
    return bad


def assert_stops_equal_plain(server, plain_server, prompt_ids: list[list[int]], tokenizer) -> None:
    """The cases really stop early in plain decoding (not vacuous), and `server` equals plain decoding on each."""
    cases = stop_cases(plain_server, prompt_ids, tokenizer)
    want = plain_outputs(plain_server, prompt_ids, cases)
    for name in ("stop_token_ids", "stop_strings", "eos", "min_new_tokens"):
        lengths = [len(o["output_ids"]) for o in want[name]]
        assert all(n < MAX_NEW for n in lengths), (name, lengths)  # every row ended on its stop
    bad = stop_mismatches(server, prompt_ids, cases, want)
    assert not bad, "\n".join(bad)
