"""Long prompts and the context limit on speculative servers (tests/integration: chain, tree and ragged steps).

The drafter's context is built from the target's prefill hidden states; a prompt longer than the chunk size is
prefilled in several chunks (SGLang's chunked prefill), each chunk's hidden states appended to the draft context in
turn. A server under test and the plain decoding server it is compared with both run `chunked_prefill_size: CHUNK`
and `context_length: CONTEXT` (`with_long_prompt_limits`): prompts of 3 and 5 chunks, alone and batched, then one
decoded to the context limit (where the decode reserve -- the width of a tree's window, or two chain blocks -- no
longer fits past the committed length; SGLang ends such a request a token or two short of the limit, plain decoding
too). Greedy output and finish reason equal plain decoding's.
"""
from __future__ import annotations

import json
import re
import urllib.request

CHUNK = 64
CONTEXT = 512
SERVER_ARGS = {"chunked_prefill_size": CHUNK}
MODEL_ARGS = {"context_length": CONTEXT}
LENGTHS = (150, 300)  # tokens: 3 and 5 chunks
NEW = 32


def with_long_prompt_limits(cfg: dict) -> dict:
    """`cfg` (a server config) with the chunk size and context limit the long-prompt checks need."""
    cfg["sglang_args"] = {**cfg.get("sglang_args", {}), **SERVER_ARGS}
    cfg["model"] = {**cfg["model"], **MODEL_ARGS}
    return cfg


def long_prompt_ids(tokenizer, n: int, seed: int = 0) -> list[int]:
    """A code-like prompt of exactly `n` tokens (numbered functions: the continuation is predictable, so drafts are
    accepted across the chunk boundaries' context)."""
    lines, ids = [], []
    i = seed
    while len(ids) < n:
        lines.append(f"def f{i}(x):\n    return x + {i}\n\n")
        ids = tokenizer("".join(lines))["input_ids"]
        i += 1
    return ids[:n]


def _generate(server, input_ids, **sampling) -> list[dict] | dict:
    body = {"input_ids": input_ids, "sampling_params": {"temperature": 0, "ignore_eos": True, **sampling}}
    req = urllib.request.Request(f"{server.url}/generate", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as r:
        return json.load(r)


def _summary(out: dict) -> tuple:
    return out["output_ids"], out["meta_info"]["finish_reason"]


def _difference(want: dict, got: dict) -> str:
    w, g = want["output_ids"], got["output_ids"]
    at = next((i for i, (x, y) in enumerate(zip(w, g)) if x != y), min(len(w), len(g)))
    return (f"plain: {len(w)} tokens, {want['meta_info']['finish_reason']}; speculative: {len(g)} tokens, "
            f"{got['meta_info']['finish_reason']}; first difference at {at}: {w[at:at + 4]} vs {g[at:at + 4]}")


def assert_long_prompts_equal_plain(server, plain_server, tokenizer) -> None:
    prompts = [long_prompt_ids(tokenizer, n, seed) for seed, n in enumerate(LENGTHS)]
    want = [_summary(o) for o in _generate(plain_server, prompts, max_new_tokens=NEW)]
    assert [_summary(_generate(server, p, max_new_tokens=NEW)) for p in prompts] == want, "one at a time"
    assert [_summary(o) for o in _generate(server, prompts, max_new_tokens=NEW)] == want, "batched"
    chunks = re.findall(r"Prefill batch, #new-seq: \d+, #new-token: (\d+)", server.log_path.read_text())
    assert str(CHUNK) in chunks, "no prompt was prefilled in chunks of the configured size"
    # decoded to the context limit: the last allowed token lands in a verify step whose reserve is cut
    p = prompts[1]
    to_limit = CONTEXT - len(p)
    got = _generate(server, p, max_new_tokens=to_limit)
    want = _generate(plain_server, p, max_new_tokens=to_limit)
    assert _summary(got) == _summary(want), _difference(want, got)
    assert len(got["output_ids"]) >= to_limit - 4 and got["meta_info"]["finish_reason"]["type"] == "length"
    assert got["meta_info"]["spec_accept_length"] > 1.5, "no draft was accepted on the way to the limit"
