"""Upstream's Triton DFlash kernels through the DFLASH_ADAPTIVE worker, on CPU: the branches SGLang takes on a GPU.

SGLang guards its Triton prepare-block and greedy accept/bonus kernels (sglang/kernels/ops/speculative/dflash.py)
by CUDA checks, so a CPU server never runs them. With DFLASH_SERVE_TRITON_ON_CPU=1 and TRITON_INTERPRET=1 the
adaptive worker takes those branches and Triton's interpreter runs the kernels on CPU tensors, with the buffers,
strides and views a GPU would use (docs/ARCHITECTURE.md §7).

The cycle mode verifies widths 1, 2, 4, 8, 16, 1, ...: widths shrink and grow every step (a width-1 step has nothing
to verify and samples its token itself, steps/accept.py accept_width1; every wider step takes the Triton accept). Before the fix of the accept buffers (upstream sizes them by ``self.block_size``, which is the
verify width during the accept) the width-2 step after the first width-1 accept got a [cap, 1] buffer: the Triton
accept raised "shape '[1, 2]' is invalid for input of size 1", upstream fell back to the eager path for good and this
test failed on its log check; tests/unit/test_accept_buffers.py pins the allocation itself.
With per-request widths on, the batched requests run ragged steps too: the Triton accept then reads a [bs, W]
candidate block whose padded entries are -1 (steps/ragged.py).
"""
from __future__ import annotations

import pytest

from harness.server import ManagedServer
from sglang_ext import names
from tests.conftest import default_config
from tests.integration.test_adaptive import scrape
from tests.integration.test_lossless import MAX_NEW, plain_greedy, prompt_ids  # noqa: F401  (fixtures)

pytestmark = pytest.mark.server
ENABLED = "upstream Triton prepare-block and accept/bonus kernels on CPU"
FELL_BACK = "falling back to eager path"  # upstream's warning when a Triton branch raised


@pytest.fixture(scope="module")
def triton_server(tiny_pair, tmp_path_factory):
    cfg = default_config(tiny_pair, algorithm="dflash_adaptive", draft_model_path=tiny_pair["drafter"])
    cfg["speculative"]["adaptive"] = {"mode": "cycle", "per_request_widths": True}
    env = {names.TRITON_ON_CPU: "1", names.TRITON_INTERPRET: "1"}
    with ManagedServer(cfg, tmp_path_factory.mktemp("triton"), "adaptive-triton", env=env) as server:
        yield server


def test_greedy_equals_plain_with_upstream_triton_kernels_while_widths_shrink_and_grow(
        triton_server, plain_greedy, prompt_ids):
    single = [triton_server.generate(ids, max_new_tokens=MAX_NEW, temperature=0) for ids in prompt_ids]
    assert [r["output_ids"] for r in single] == plain_greedy
    batched = triton_server.generate(prompt_ids, max_new_tokens=MAX_NEW, temperature=0)
    assert [r["output_ids"] for r in batched] == plain_greedy
    assert sum(scrape(triton_server, "dflash_ragged_steps_total").values()) > 0  # ragged steps took the kernel
    assert max(r["meta_info"]["spec_accept_length"] for r in single) > 1.5  # drafts really accepted
    log = triton_server.log_tail(10_000)
    assert ENABLED in log, "the worker did not take the Triton branches"
    assert FELL_BACK not in log, "a Triton kernel raised and upstream fell back to the eager path"
    assert triton_server.proc.poll() is None

