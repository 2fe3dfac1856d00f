"""Drafter training data is the target's own greedy output, produced by the real SGLang server."""
from __future__ import annotations

import torch

from dflash_models import regen


def test_regenerated_responses_are_the_targets_greedy_continuations(tiny_pair):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = tiny_pair["target"]
    out = regen.regenerate(target, n_prompts=6, max_new=12, concurrency=3, max_prompt_tokens=48, threads=1,
                           log=lambda *_: None)
    tok = AutoTokenizer.from_pretrained(str(target))
    stop = {tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")}
    assert len(out["sequences"]) == 6 and len(out["response_start"]) == 6
    assert set(out["kinds"]) <= {"code", "chat"}

    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    for seq, start in zip(out["sequences"], out["response_start"]):
        prompt, resp = seq[:start], seq[start:]
        assert 0 < start <= 48 and 0 < len(resp) <= 12
        assert all(t not in stop for t in resp[:-1]), "the response is cut after its first end token"
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=len(resp), do_sample=False,
                                 eos_token_id=sorted(stop), pad_token_id=min(stop))[0, start:].tolist()
        assert resp == ref
