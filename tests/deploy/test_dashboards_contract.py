"""The DFlash dashboard and rules against the metrics contract (docs/ARCHITECTURE.md §4), through a real Prometheus:
a synthetic exporter publishes exactly the contracted names, types and labels, Prometheus scrapes it with the
compose stack's config and rules, and every DFlash panel and every recording rule must return data. (The live
test checks the same against the real server.)"""
from __future__ import annotations

import time

import pytest

from deploy import promstack
from harness.server import free_port
from tests.deploy.conftest import tool
from tests.deploy.fake_dflash import CONTRACT, FakeDFlash

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def fake_stack(tmp_path_factory):
    binary = tool("prometheus")
    port = free_port()
    fake = FakeDFlash("fake").start(port)
    learner = _learner_metrics()
    try:
        with promstack.LocalPrometheus([f"127.0.0.1:{port}"], tmp_path_factory.mktemp("prom"), "1s",
                                       binary, learner_targets=[f"127.0.0.1:{learner.port}"]) as prom:
            prom.wait_for_scrapes()
            start = time.time()
            time.sleep(12)
            yield prom, start
    finally:
        fake.stop()


def _learner_metrics():
    """The learner's own exporter (dflash_models/learn/metrics.py) on a free port, as after a refused round, a
    promoted one and a round in progress."""
    from dflash_models.learn.metrics import LearnMetrics

    m = LearnMetrics(free_port())
    m.rounds.labels(outcome="refused").inc()
    m.rounds.labels(outcome="promoted").inc()
    m.set_serving("v0001")
    for slice_, drafter, v in (("recent", "serving", 4.8), ("recent", "candidate", 5.1),
                               ("original", "serving", 7.2), ("original", "candidate", 7.1)):
        m.tps.labels(slice=slice_, drafter=drafter).set(v)
    m.captured.set(640)
    m.loss.set(0.8)
    m.progress.set(0.5)
    m.tokens.inc(4000)
    return m


def _empty(prom, start: float, name: str) -> list[str]:
    dash = promstack.load_dashboards()[name]
    variables = promstack.resolve_variables(dash, prom.client)
    empty = []
    end = time.time()
    for q in promstack.panel_queries(name, dash):
        expr = promstack.substitute(q.expr, variables, rate_interval="5s", range_=f"{int(end - start)}s")
        result = prom.client.query(expr, end) if q.instant else prom.client.query_range(expr, start, end, 1)
        if not promstack.finite_points(result):
            empty.append(f"{q.panel} [{q.ref}]: {expr}")
    return empty


def test_exporter_publishes_the_contract(fake_stack):
    prom, _ = fake_stack
    names = set(prom.client.label_values("__name__"))
    for name, (kind, labels) in CONTRACT.items():
        samples = name + "_bucket" if kind == "histogram" else name
        assert samples in names, name
        series = prom.client.query(samples)
        assert all(set(labels) | {"model_name"} <= set(s["metric"]) for s in series), name


def test_every_dflash_panel_has_data(fake_stack):
    prom, start = fake_stack
    dash = promstack.load_dashboards()["dflash"]
    variables = promstack.resolve_variables(dash, prom.client)
    server = prom.client.query('up{job="dflash-serve"}')[0]["metric"]["instance"]
    assert variables == {"model": ["fake"], "instance": [server]}
    empty = _empty(prom, start, "dflash")
    assert not empty, "panels without data:\n" + "\n".join(empty)


def test_every_learning_panel_has_data(fake_stack):
    """The learning dashboard: the servers' acceptance and drafter version, and the learner's own exporter scraped
    as the stack scrapes it (job dflash-learn)."""
    prom, start = fake_stack
    empty = _empty(prom, start, "learning")
    assert not empty, "panels without data:\n" + "\n".join(empty)


def test_every_rule_evaluates_and_records_data(fake_stack):
    prom, _ = fake_stack
    groups = prom.client.rules()
    assert groups
    for g in groups:
        for r in g["rules"]:
            assert r["health"] == "ok", (r["name"], r.get("lastError"))
            if r["type"] == "recording":
                assert prom.client.query(r["name"]), f"recording rule {r['name']} has no data"
