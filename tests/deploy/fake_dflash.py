"""A synthetic exporter of the DFlash metrics contract (docs/ARCHITECTURE.md §4, sglang_ext/metrics.py), for testing the rules and dashboards
against a real Prometheus without a server: exactly the contracted names, types and labels, with values that
move like a controller's under a changing load.
"""
from __future__ import annotations

import math
import random
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import start_http_server

POSITIONS = range(1, 16)
BLOCKS = (1, 2, 4, 8, 16, 32)  # 32: a DDTree of 31 prefixes
BUCKETS = (1, 2, 4, 8, 16, 32, 64)

# name -> (type, extra labels); every series also carries model_name
CONTRACT = {
    "dflash_verify_steps_total": ("counter", ()),
    "dflash_draft_tokens_total": ("counter", ()),
    "dflash_accepted_tokens_total": ("counter", ()),
    "dflash_accepted_tokens_by_position_total": ("counter", ("position",)),
    "dflash_tried_tokens_by_position_total": ("counter", ("position",)),
    "dflash_block_size_steps_total": ("counter", ("block_size",)),
    "dflash_block_size_switches_total": ("counter", ()),
    "dflash_controller_errors_total": ("counter", ()),
    "dflash_probe_steps_total": ("counter", ("block_size",)),
    "dflash_tree_steps_total": ("counter", ("budget",)),
    "dflash_tree_extra_tokens_total": ("counter", ("budget",)),
    "dflash_ragged_steps_total": ("counter", ()),
    "dflash_plain_decode_steps_total": ("counter", ()),
    "dflash_ragged_request_steps_total": ("counter", ("block_size",)),
    "dflash_block_size": ("gauge", ()),
    "dflash_live_request_states": ("gauge", ()),
    "dflash_predicted_goodput_tokens_per_second": ("gauge", ()),
    "dflash_acceptance_probability": ("gauge", ("position",)),
    "dflash_tree_expected_extra_tokens": ("gauge", ("budget", "sampling")),
    "dflash_width_calibration": ("gauge", ("block_size", "sampling")),
    "dflash_step_cost_seconds": ("gauge", ("batch_bucket", "block_size")),
    "dflash_drafter_swaps_total": ("counter", ()),
    "dflash_drafter_info": ("gauge", ("drafter_version",)),
    "dflash_step_seconds": ("histogram", ("block_size",)),
    "dflash_committed_tokens_per_step": ("histogram", ()),
}


class FakeDFlash:
    def __init__(self, model_name: str = "fake", seed: int = 0):
        self.model = model_name
        self.rng = random.Random(seed)
        self.registry = CollectorRegistry()
        m = {}
        for name, (kind, labels) in CONTRACT.items():
            labelnames = ("model_name", *labels)
            base = name.removesuffix("_total") if kind == "counter" else name
            if kind == "counter":
                m[name] = Counter(base, name, labelnames, registry=self.registry)
            elif kind == "gauge":
                m[name] = Gauge(base, name, labelnames, registry=self.registry)
            elif name == "dflash_step_seconds":
                m[name] = Histogram(name, name, labelnames, registry=self.registry,
                                    buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0))
            else:
                m[name] = Histogram(name, name, labelnames, registry=self.registry, buckets=tuple(range(1, 17)))
        # the SGLang series the DFlash dashboard reads besides the contract (its template variables, and SGLang's
        # own tokens per verify call for comparison); their names are checked against a real server elsewhere
        m["sglang:num_running_reqs"] = Gauge("sglang:num_running_reqs", "running", ["model_name"],
                                             registry=self.registry)
        m["sglang:generation_tokens_total"] = Counter("sglang:generation_tokens", "generated", ["model_name"],
                                                      registry=self.registry)
        m["sglang:spec_verify_calls_total"] = Counter("sglang:spec_verify_calls", "verify calls", ["model_name"],
                                                      registry=self.registry)
        self.m = m
        self.block = 8
        self.width1_steps = 0
        self.steps = 0
        self.stop_event = threading.Event()
        self.server = None
        self.thread = None
        self.port = None

    def step(self, t: float) -> None:
        """One decode step of a batch whose size swings with time; the controller shrinks the block as it grows."""
        lab = {"model_name": self.model}
        m = self.m
        batch = max(1, int(16 + 15 * math.sin(t / 4)))
        p = [0.92 * 0.97 ** j for j in range(15)]
        best = 32 if batch < 3 else 16 if batch < 6 else 8 if batch < 14 else 4 if batch < 24 else 2 if batch < 28 else 1
        if best != self.block:
            m["dflash_block_size_switches_total"].labels(**lab).inc()
            self.block = best
        b = self.block
        m["dflash_block_size"].labels(**lab).set(b)
        m["dflash_live_request_states"].labels(**lab).set(batch)
        m["dflash_controller_errors_total"].labels(**lab).inc(0)
        m["dflash_drafter_swaps_total"].labels(**lab).inc(0)
        m["dflash_drafter_info"].labels(**lab, drafter_version="initial").set(1)
        m["dflash_block_size_steps_total"].labels(**lab, block_size=str(b)).inc()
        self.width1_steps += b == 1
        self.steps += 1
        probe = (b == 1 and self.width1_steps % 4 == 0) or (1 < b < 16 and self.steps % 32 == 0)
        m["dflash_probe_steps_total"].labels(**lab, block_size=str(b)).inc(probe)  # width 1 every 4, others every 32
        m["dflash_plain_decode_steps_total"].labels(**lab).inc(b == 1 and not probe)  # width 1 without a draft
        tree = b > 16  # a width above the drafter's block verifies a tree of b - 1 prefixes
        m["dflash_tree_steps_total"].labels(**lab, budget="31").inc(tree)
        m["dflash_tree_extra_tokens_total"].labels(**lab, budget="31").inc(self.rng.randint(0, batch) if tree else 0)
        m["dflash_tree_expected_extra_tokens"].labels(**lab, budget="31", sampling="greedy").set(
            0.3 + 0.1 * math.sin(t))
        for b in (2, 4, 8):
            m["dflash_width_calibration"].labels(**lab, block_size=str(b), sampling="greedy").set(
                1.0 + 0.05 * math.sin(t + b))
        ragged = self.steps % 3 == 0  # per-request widths: a third of the steps, half the requests at width 1
        m["dflash_ragged_steps_total"].labels(**lab).inc(ragged)
        for w, n in ((1, batch // 2), (16, batch - batch // 2)):
            m["dflash_ragged_request_steps_total"].labels(**lab, block_size=str(w)).inc(n if ragged else 0)
        step_s = 0.01 + 0.0004 * batch * b
        m["dflash_step_seconds"].labels(**lab, block_size=str(b)).observe(step_s * self.rng.uniform(0.9, 1.2))
        committed_all = 0
        for _ in range(batch):
            accepted = 0
            for j in range(min(b, 16) - 1):
                m["dflash_tried_tokens_by_position_total"].labels(**lab, position=str(j + 1)).inc()
                if self.rng.random() < p[j]:
                    accepted += 1
                    m["dflash_accepted_tokens_by_position_total"].labels(**lab, position=str(j + 1)).inc()
                else:
                    break
            m["dflash_verify_steps_total"].labels(**lab).inc()
            m["dflash_draft_tokens_total"].labels(**lab).inc(b - 1)
            m["dflash_accepted_tokens_total"].labels(**lab).inc(accepted)
            m["dflash_committed_tokens_per_step"].labels(**lab).observe(accepted + 1)
            committed_all += accepted + 1
        m["sglang:num_running_reqs"].labels(**lab).set(batch)
        m["sglang:generation_tokens_total"].labels(**lab).inc(committed_all)
        m["sglang:spec_verify_calls_total"].labels(**lab).inc()
        expected = sum(math.prod(p[:k]) for k in range(min(b, 16)))
        m["dflash_predicted_goodput_tokens_per_second"].labels(**lab).set(batch * expected / step_s)
        for j in POSITIONS:
            m["dflash_acceptance_probability"].labels(**lab, position=str(j)).set(p[j - 1])
        for bb in BUCKETS:
            for bs in BLOCKS:
                m["dflash_step_cost_seconds"].labels(**lab, batch_bucket=str(bb), block_size=str(bs)).set(
                    0.01 + 0.0004 * bb * bs)

    def start(self, port: int) -> FakeDFlash:
        self.port = port
        self.server, self.thread = start_http_server(port, addr="127.0.0.1", registry=self.registry)
        self.step(0.0)
        t0 = time.monotonic()

        def run():
            while not self.stop_event.wait(0.05):
                self.step(time.monotonic() - t0)

        self.worker = threading.Thread(target=run, daemon=True)
        self.worker.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        if self.server:
            self.server.shutdown()
            self.server.server_close()
