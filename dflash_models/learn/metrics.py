"""The learner's own /metrics (prometheus-client, its own port: `learning.metrics_port`), scraped by Prometheus as
job `dflash-learn` (deploy/prometheus). Every series is the learner process's; the servers' side of a swap is
dflash_drafter_info / dflash_drafter_swaps_total on their own /metrics."""
from __future__ import annotations


class LearnMetrics:
    def __init__(self, port: int | None, registry=None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.rounds = Counter("dflash_learn_rounds", "Learning rounds by outcome (promoted, refused, waiting, "
                              "failed)", ["outcome"], registry=r)
        self.loss = Gauge("dflash_learn_loss", "Fine-tuning loss (EMA) of the round in progress", registry=r)
        self.tokens = Counter("dflash_learn_tokens_seen", "Block-position tokens trained on", registry=r)
        self.progress = Gauge("dflash_learn_progress", "Steps done / steps of the round in progress", registry=r)
        self.captured = Gauge("dflash_learn_captured_sequences", "Captured requests in the store at the last round",
                              registry=r)
        self.tps = Gauge("dflash_learn_tokens_per_step", "Offline tokens per step at the last gate",
                         ["slice", "drafter"], registry=r)
        self.serving = Gauge("dflash_learn_serving_info", "1 for the drafter version the learner serves",
                             ["drafter_version"], registry=r)
        self._serving: str | None = None
        self.port = None
        if port is not None:
            start_http_server(port, registry=r)
            self.port = port

    def set_serving(self, version: str) -> None:
        if self._serving is not None and self._serving != version:
            self.serving.labels(drafter_version=self._serving).set(0)
        self.serving.labels(drafter_version=version).set(1)
        self._serving = version
