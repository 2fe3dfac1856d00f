"""A DFlash2 drafter (candidate selector + grouped convolutions) served on CPU: upstream `dflash` and
`dflash_adaptive` (switching width every step, width 1 and the full block included) give plain decoding's greedy
output token for token while committing several tokens a step, and sampled output keeps plain decoding's
distribution through the selector's own q (rejection sampling against a drafted distribution, not a one-hot one).

The drafter is the bundled trained DFlash drafter with DFlash2's parts added (dflash_models/dflash2.py), so the
multi-token accept path really runs. Before the CPU layer's draft-probability sampler (cpu/sampling.py) the first
sampled request crashed both servers' schedulers (upstream's Triton rejection kernel has no CPU device); before
the adaptive worker served DFlash2 it refused the drafter at start-up.
"""
from __future__ import annotations

import pytest

from harness.server import ManagedServer, side_by_side
from tests.conftest import default_config
from tests.integration.test_adaptive import by_label, scrape
from tests.integration.test_lossless import (MAX_NEW, assert_sampling_lossless, plain_greedy,  # noqa: F401
                                             prompt_ids)

pytestmark = pytest.mark.server
CYCLE = [1, 2, 16, 4, 1, 16, 2, 8]  # every chain width, width 1 next to the full block and to itself


@pytest.fixture(scope="module")
def dflash2_drafter(tiny_pair, tmp_path_factory):
    from dflash_models import dflash2

    return dflash2.convert(tiny_pair["drafter"], tmp_path_factory.mktemp("dflash2") / "drafter")


@pytest.fixture(scope="module")
def servers(tiny_pair, dflash2_drafter, tmp_path_factory):
    """upstream dflash and dflash_adaptive (cycle mode; fixed at the full block) with the DFlash2 drafter, started
    side by side."""
    workdir = tmp_path_factory.mktemp("dflash2-servers")

    def config(algorithm: str, adaptive: dict | None = None) -> dict:
        cfg = default_config(tiny_pair, algorithm=algorithm, draft_model_path=dflash2_drafter)
        if adaptive:
            cfg["speculative"]["adaptive"] = adaptive
        return cfg

    made = {"dflash": ManagedServer(config("dflash"), workdir, "dflash"),
            "adaptive": ManagedServer(config("dflash_adaptive", {"mode": "cycle", "candidates": [1, 2, 4, 8, 16],
                                                                 "cycle_pattern": CYCLE}), workdir, "adaptive"),
            "full": ManagedServer(config("dflash_adaptive", {"mode": "fixed", "fixed_block": 16}), workdir, "full")}
    with side_by_side(made):
        yield made


@pytest.mark.parametrize("name", ["dflash", "adaptive"])
def test_greedy_equals_plain_decoding_with_several_tokens_committed_a_step(servers, name, plain_greedy, prompt_ids):
    server = servers[name]
    single = [server.generate(ids, max_new_tokens=MAX_NEW, temperature=0) for ids in prompt_ids]
    assert [r["output_ids"] for r in single] == plain_greedy
    batched = server.generate(prompt_ids, max_new_tokens=MAX_NEW, temperature=0)
    assert [r["output_ids"] for r in batched] == plain_greedy
    accept = [r["meta_info"]["spec_accept_length"] for r in single]
    assert sum(accept) / len(accept) >= 2.0, accept  # the multi-token accept path, not width 1 alone
    if name == "adaptive":  # every width of the cycle ran
        steps = by_label(scrape(server, "dflash_block_size_steps_total"), "block_size")
        assert {b for b, n in steps.items() if n > 0} >= {"1", "2", "4", "8", "16"}, steps


def test_at_the_full_block_adaptive_verifies_the_selectors_path_as_upstream_does(servers, prompt_ids):
    """Greedy, one request at a time: the same path proposed (the selector's walk, not the backbone's argmax) gives
    the same tokens accepted per step as upstream's DFlash2 worker, request by request."""
    def accepts(server):
        return [server.generate(ids, max_new_tokens=MAX_NEW, temperature=0)["meta_info"]["spec_accept_length"]
                for ids in prompt_ids]

    assert accepts(servers["full"]) == pytest.approx(accepts(servers["dflash"]))


@pytest.mark.parametrize("sampling", [{}, {"top_p": 0.8}], ids=["plain", "top_p"])
def test_adaptive_sampling_through_the_selector_keeps_plain_distribution(servers, plain_server, tokenizer, sampling):
    """tests/integration/test_lossless.py's sampling test (temperature 1), with the selector's sampled path and its
    q verified at every width of the cycle."""
    assert_sampling_lossless(servers["adaptive"], plain_server, tokenizer, sampling)
    assert servers["adaptive"].proc.poll() is None


def test_upstream_dflash_sampling_with_the_selector_keeps_plain_distribution(servers, plain_server, tokenizer):
    assert_sampling_lossless(servers["dflash"], plain_server, tokenizer, {})
