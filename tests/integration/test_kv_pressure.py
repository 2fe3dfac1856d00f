"""KV pressure: with a pool too small for the batch and SGLang's forced retraction (SGLANG_TEST_RETRACT: every
few decode steps the scheduler retracts requests and re-admits them later), every step kind -- chain, width 1
with its deferred draft-KV append, tree, per-request widths -- finishes every request, still decodes exactly what
plain decoding decodes, and gives back every KV slot and every per-request controller state once idle.
"""
from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness.server import http_json
from tests.integration.test_adaptive import adaptive_config, by_label, plain_steps, scrape

pytestmark = [pytest.mark.server]

MAX_NEW = 160
CONCURRENT = 12
# smaller than the batch's demand (12 x (prompt + 160 + the tree's 80-slot window)): decode runs out of KV
POOL_TOKENS = 1536
ADMIN, ADMIN_ENV = "kv-pressure-admin-5e1d", "DFLASH_KV_PRESSURE_ADMIN_KEY"  # /abort_request is an admin route
# retracted requests wait in the queue while more than 3 run (aborts reach them there)
PRESSURE_ENV = {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_NO_PREFILL_BS": "3",
                "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1", ADMIN_ENV: ADMIN}
# one step kind per decode step, every kind in every few steps: chain 16, width 1 (deferred append), trees 32, 64
STEP_KINDS = [16, 1, 1, 64, 8, 32, 1]
SERVERS = {
    "cycle": dict(mode="cycle", candidates=[1, 8, 16, 32, 64], cycle_pattern=STEP_KINDS),
    "per-request": dict(mode="cycle", candidates=[1, 2, 4, 8, 16], cycle_pattern=[16, 1, 4, 16, 8, 2, 1],
                        per_request_widths=True),
}


@pytest.fixture(scope="module", params=list(SERVERS))
def pressure_server(request, module_server_factory, tiny_pair):
    cfg = adaptive_config(tiny_pair, **SERVERS[request.param])
    cfg["server"] |= {"max_total_tokens": POOL_TOKENS, "max_running_requests": CONCURRENT,
                      "admin_api_key_env": ADMIN_ENV}
    return module_server_factory(cfg, f"kv-pressure-{request.param}", env=PRESSURE_ENV)


@pytest.fixture(scope="module")
def pressure_prompts(tokenizer):
    from tests.conftest import PROMPTS

    return [tokenizer(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)))["input_ids"] for i in range(CONCURRENT)]


@pytest.fixture(scope="module")
def plain_outputs(plain_server, pressure_prompts):
    return plain_server.generate(pressure_prompts, max_new_tokens=MAX_NEW, temperature=0)


def _gauge(server, name: str) -> float:
    return sum(scrape(server, name).values())


def _idle(server, timeout: float = 60) -> tuple[float, float]:
    """(KV tokens in use, live controller states) once both read 0, or their last values after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        used, live = _gauge(server, "sglang:num_used_tokens"), _gauge(server, "dflash_live_request_states")
        if (used, live) == (0, 0) or time.monotonic() > deadline:
            return used, live
        time.sleep(1)


def _ran_every_step_kind(server, kind: str) -> bool:
    if kind == "per-request":
        return sum(scrape(server, "dflash_ragged_steps_total").values()) > 0
    steps = by_label(scrape(server, "dflash_block_size_steps_total"), "block_size")
    return all(steps.get(str(w), 0) > 0 for w in STEP_KINDS) and plain_steps(server) > 0  # width 1: plain steps


def test_retraction_storm_loses_nothing_and_leaks_nothing(request, pressure_server, pressure_prompts, plain_outputs):
    with ThreadPoolExecutor(CONCURRENT) as pool:
        out = list(pool.map(lambda ids: pressure_server.generate(ids, max_new_tokens=MAX_NEW, temperature=0),
                            pressure_prompts))
    assert [r["meta_info"]["finish_reason"] for r in out] == [r["meta_info"]["finish_reason"] for r in plain_outputs]
    assert [r["output_ids"] for r in out] == [r["output_ids"] for r in plain_outputs]
    assert re.search(r"#retracted_reqs: [1-9]", pressure_server.log_tail(100000))  # the storm really retracted
    assert _ran_every_step_kind(pressure_server, request.node.callspec.params["pressure_server"])
    assert _idle(pressure_server) == (0, 0)
    assert pressure_server.proc.poll() is None, pressure_server.log_tail()


def test_requests_aborted_mid_storm_leave_no_kv_or_controller_state(pressure_server, pressure_prompts):
    """Requests aborted while running, or while waiting re-queued by a retraction (the scheduler ends those itself,
    outside a batch's results), free their KV and their controller state."""
    rids = [f"aborted-{i}-{time.monotonic_ns()}" for i in range(CONCURRENT)]

    def run(ids_rid) -> str:
        ids, rid = ids_rid
        body = {"rid": rid, "input_ids": ids,
                "sampling_params": {"max_new_tokens": 2 * MAX_NEW, "temperature": 0, "ignore_eos": True}}
        try:
            return http_json(f"{pressure_server.url}/generate", body, timeout=300)["meta_info"]["finish_reason"]["type"]
        except urllib.error.HTTPError:  # an aborted request's answer
            return "abort"

    with ThreadPoolExecutor(CONCURRENT) as pool:
        answers = pool.map(run, zip(pressure_prompts, rids))
        time.sleep(1)  # decoding, retracting and re-queueing
        for rid in rids:
            abort = urllib.request.Request(f"{pressure_server.url}/abort_request", json.dumps({"rid": rid}).encode(),
                                           {"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN}"})
            urllib.request.urlopen(abort, timeout=30).close()
        answers = list(answers)
    assert set(answers) <= {"abort", "length"} and answers.count("abort") >= CONCURRENT // 2, answers
    assert _idle(pressure_server) == (0, 0)
    assert pressure_server.proc.poll() is None, pressure_server.log_tail()
