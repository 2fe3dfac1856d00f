"""Drafters whose config.json has exactly the fields z-lab publishes (Qwen3-8B-DFlash-b16's layout and a DFlash2
drafter's: dflash_models/real_layout.py) served by `dflash_adaptive` on CPU: greedy output equals plain decoding
token for token, single and batched, every chain width of the cycle included.

Both carry the bundled trained drafter's weights, so drafts are accepted. The DFlash2 layout's layers are
non-causal sliding-window layers; its window here is shorter than the served sequences, so the CPU layer's window
on the drafter's block attention (patches/cpu_layer.py) really drops context.
"""
from __future__ import annotations

import pytest

from dflash_models import real_layout
from tests.conftest import default_config
from tests.integration.test_adaptive import by_label, scrape
from tests.integration.test_lossless import MAX_NEW, plain_greedy, prompt_ids  # noqa: F401

pytestmark = pytest.mark.server
CYCLE = [1, 2, 16, 4, 1, 16, 2, 8]  # every chain width, width 1 next to the full block and to itself
SLIDING_WINDOW = 16  # shorter than every prompt plus its MAX_NEW tokens


@pytest.mark.parametrize("layout", real_layout.LAYOUTS)
def test_adaptive_serves_the_published_layout_as_plain_decoding(layout, tiny_pair, tmp_path_factory, plain_greedy,
                                                                prompt_ids, module_server_factory, request):
    drafter = real_layout.build(layout, tiny_pair["drafter"], tmp_path_factory.mktemp(layout) / "drafter",
                                target_dir=tiny_pair["target"], sliding_window=SLIDING_WINDOW)
    cfg = default_config(tiny_pair, algorithm="dflash_adaptive", draft_model_path=drafter)
    cfg["speculative"]["adaptive"] = {"mode": "cycle", "candidates": [1, 2, 4, 8, 16], "cycle_pattern": CYCLE}
    server = module_server_factory(cfg, f"real-{layout}")
    request.addfinalizer(server.stop)  # one server at a time: each costs memory
    single = [server.generate(ids, max_new_tokens=MAX_NEW, temperature=0) for ids in prompt_ids]
    assert [r["output_ids"] for r in single] == plain_greedy
    batched = server.generate(prompt_ids, max_new_tokens=MAX_NEW, temperature=0)
    assert [r["output_ids"] for r in batched] == plain_greedy
    accept = [r["meta_info"]["spec_accept_length"] for r in single]
    assert max(accept) > 1.5, accept  # drafts accepted: the multi-token commit ran, not width 1 alone
    steps = by_label(scrape(server, "dflash_block_size_steps_total"), "block_size")
    assert {b for b, n in steps.items() if n > 0} >= {"1", "2", "4", "8", "16"}, steps
