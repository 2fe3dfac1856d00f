"""The support matrix's target families (docs/MODELS.md) served through real CPU servers: each family's tiny
random target of the real architecture (dflash_models/families.py) with a matching random DFlash drafter.

`dflash_adaptive` in cycle mode (every candidate width in turn, width 1 and every transition included) must emit
what plain decoding emits, token for token, single and batched. The plain reference is transformers' own greedy
decoding of the same checkpoint in fp32, which SGLang's plain decoding equals (tests/integration/test_lossless.py
pins that for the bundled pair; here `test_every_algorithm_serves_the_family` pins it per family): one server per
family keeps the module inside its CI budget. Setting DFLASH_SERVE_FAMILY_ALGORITHMS=1 also serves every family
with `none` and upstream's `dflash` (two more servers per family) and compares them with the same reference.
Qwen3 dense is the bundled pair's family: every other integration test serves it.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import PROMPTS, default_config
from tests.integration.test_adaptive import by_label, scrape

pytestmark = pytest.mark.server
FAMILIES = ("llama3", "qwen3_moe", "gemma4", "gpt_oss")
MAX_NEW = 16
CANDIDATES = (1, 2, 4, 8)  # the tiny drafters' block is 8
ALL_ALGORITHMS = os.environ.get("DFLASH_SERVE_FAMILY_ALGORITHMS") == "1"


@pytest.fixture(scope="module")
def family_pairs(tmp_path_factory) -> dict[str, dict]:
    from dflash_models import families

    root = tmp_path_factory.mktemp("families")
    return {name: families.build(name, root / name) for name in FAMILIES}


@pytest.fixture(scope="module")
def prompt_ids(family_pairs) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(family_pairs[FAMILIES[0]]["target"]))  # the bundled tokenizer, shared
    return [tok(p)["input_ids"] for p in PROMPTS[:4]]


def reference(pair: dict, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy decoding of the target in fp32 (plain decoding's reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(pair["target"]), dtype=torch.float32).eval()
    out = []
    for ids in prompts:
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                                 do_sample=False, pad_token_id=0)
        out.append(gen[0, len(ids):].tolist())
    return out


def config(pair: dict, algorithm: str) -> dict:
    if algorithm == "none":
        return default_config(pair, algorithm="none")
    cfg = default_config(pair, algorithm=algorithm, draft_model_path=pair["drafter"])
    if algorithm == "dflash_adaptive":
        cfg["speculative"]["adaptive"] = {"mode": "cycle", "candidates": list(CANDIDATES)}
    return cfg


def serve_and_compare(factory, request, cfg: dict, name: str, prompts, expected) -> tuple:
    server = factory(cfg, name)
    request.addfinalizer(server.stop)  # one family's server at a time: each costs memory
    single = [server.generate(ids, max_new_tokens=MAX_NEW, temperature=0) for ids in prompts]
    assert [r["output_ids"] for r in single] == expected, f"{name}: single requests differ from plain decoding"
    batched = server.generate(prompts, max_new_tokens=MAX_NEW, temperature=0)
    assert [r["output_ids"] for r in batched] == expected, f"{name}: a batch differs from plain decoding"
    return server, single


@pytest.mark.parametrize("family", FAMILIES)
def test_adaptive_cycle_equals_plain_decoding(family, family_pairs, prompt_ids, module_server_factory, request):
    pair = family_pairs[family]
    expected = reference(pair, prompt_ids)
    server, single = serve_and_compare(module_server_factory, request, config(pair, "dflash_adaptive"),
                                       f"{family}-adaptive-cycle", prompt_ids, expected)
    steps = by_label(scrape(server, "dflash_block_size_steps_total"), "block_size")
    assert all(steps.get(str(b), 0) > 0 for b in CANDIDATES), steps  # every width really ran
    # the multi-token accept ran: the biased target takes some of the random drafter's tokens
    assert max(r["meta_info"]["spec_accept_length"] for r in single) > 1.2


@pytest.mark.skipif(not ALL_ALGORITHMS, reason="two servers per family: set DFLASH_SERVE_FAMILY_ALGORITHMS=1")
@pytest.mark.parametrize("algorithm", ["none", "dflash"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_algorithm_serves_the_family(family, algorithm, family_pairs, prompt_ids, module_server_factory,
                                          request):
    pair = family_pairs[family]
    serve_and_compare(module_server_factory, request, config(pair, algorithm), f"{family}-{algorithm}", prompt_ids,
                      reference(pair, prompt_ids))


@pytest.mark.skipif(not ALL_ALGORITHMS, reason="one more server: set DFLASH_SERVE_FAMILY_ALGORITHMS=1")
def test_a_draft_window_is_served_by_upstream_dflash(tmp_path_factory, prompt_ids, module_server_factory, request):
    """The drafter row "served with a draft window": upstream's `dflash` with a window shorter than every prompt
    (its compact draft cache) equals plain decoding; `dflash_adaptive` refuses it in the preflight
    (tests/unit/test_support_matrix.py)."""
    from dflash_models import families

    pair = families.build("qwen3", tmp_path_factory.mktemp("window") / "qwen3")
    cfg = config(pair, "dflash")
    cfg["sglang_args"] = {**cfg.get("sglang_args", {}), "speculative_draft_window_size": 8}
    serve_and_compare(module_server_factory, request, cfg, "qwen3-dflash-window", prompt_ids,
                      reference(pair, prompt_ids))
