"""The compose stack's CPU profile without Docker: the `dflash-serve-cpu` service's command (compose's own
resolved config + the image's ENTRYPOINT, container paths mapped to this checkout through its bind mounts) -- a
fleet of two replicas behind SGLang's router -- serves on the host; a real Prometheus on the stack's
prometheus.yml and rules finds the replicas through the fleet's file_sd targets file, scrapes them and the router
every second under a short streaming chat load through the router; then every dashboard panel's PromQL, with the
template variables Grafana would offer, must return data through Prometheus' HTTP API -- no panel left empty --
and the dashboards render."""
from __future__ import annotations

import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pytest
import yaml

from deploy import promstack, render_dashboards
from harness.server import ManagedFleet
from tests.deploy.conftest import compose_config, dockerfile_stages, exec_form, tool
from tests.deploy.test_static import SGLANG_METRICS, base_name

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

LOAD_SECONDS = 20
CONCURRENCY = 4
REPLICAS = 2  # the compose file's default (DFLASH_CPU_REPLICAS)


def compose_cpu_command() -> tuple[list[str], Path]:
    """The CPU service's argv, and its --config file on this machine."""
    service = compose_config("cpu")["services"]["dflash-serve-cpu"]
    entrypoint = service.get("entrypoint") or exec_form(dict(dockerfile_stages()["cpu"]["instructions"])["ENTRYPOINT"])
    argv = list(entrypoint) + list(service["command"])
    container_config = PurePosixPath(argv[argv.index("--config") + 1])
    for v in service["volumes"]:
        if v["type"] == "bind" and container_config.is_relative_to(v["target"]):
            return argv, Path(v["source"]) / container_config.relative_to(v["target"])
    raise AssertionError(f"{container_config} is not in a bind mount of the service: {service['volumes']}")


@dataclass
class Live:
    fleet: ManagedFleet
    prom: promstack.LocalPrometheus
    load: promstack.LoadResult
    config: dict
    end: float


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    binary = tool("prometheus")
    argv, config_path = compose_cpu_command()
    # `dflash-serve` is the console script for service.cli:main, which ManagedFleet runs as `python -m service.cli`
    assert argv[:3] == ["dflash-serve", "fleet", "--config"], argv
    config = yaml.safe_load(config_path.read_text())
    for section, key in (("model", "path"), ("model", "tokenizer"), ("speculative", "draft_model_path")):
        value = config.get(section, {}).get(key)
        if value and not Path(value).is_absolute():
            config[section][key] = str((config_path.parent / value).resolve())
    workdir = tmp_path_factory.mktemp("live")
    # the config as the container reads it, on free loopback ports instead of 0.0.0.0:30000-30002 and 29000
    fleet = ManagedFleet(config, workdir, "compose-cpu", replicas=REPLICAS, argv=argv[1:]).start()
    try:
        with promstack.LocalPrometheus([], workdir / "prometheus", "1s", binary, targets_file=fleet.targets_file,
                                       router_targets=[f"127.0.0.1:{fleet.metrics_port}"]) as prom:
            prom.wait_for_scrapes(f'count(up{{job="dflash-serve"}} == 1) == {REPLICAS}')
            prom.wait_for_scrapes('up{job="dflash-router"} == 1')
            load = promstack.chat_load(fleet.url, config["model"]["served_name"], LOAD_SECONDS, CONCURRENCY)
            time.sleep(3)  # the last scrapes and rule evaluations after the load
            yield Live(fleet, prom, load, config, time.time())
    finally:
        fleet.stop()


def test_cpu_compose_command_serves(live):
    assert not live.load.failures, live.load.failures[:5]
    assert live.load.requests >= CONCURRENCY and live.load.output_chunks > 0
    with urllib.request.urlopen(f"{live.fleet.url}/v1/models", timeout=10) as r:
        assert live.config["model"]["served_name"] in r.read().decode()
    with urllib.request.urlopen(f"{live.fleet.url}/readiness", timeout=10) as r:  # the compose healthcheck's URL
        assert r.status == 200


def test_prometheus_scrapes_sglang_metrics_under_their_names(live):
    c = live.prom.client
    up = c.query('up{job="dflash-serve"}')
    assert sorted((s["metric"]["replica"], s["value"][1]) for s in up) == [(str(i), "1") for i in range(REPLICAS)]
    assert sorted(s["metric"]["instance"] for s in up) == sorted(u.removeprefix("http://")
                                                                   for u in live.fleet.replica_urls)
    names = set(c.label_values("__name__"))
    missing = {m for m in SGLANG_METRICS if m not in names and f"{m}_bucket" not in names}
    assert not missing, f"SGLang does not export {sorted(missing)} (or the relabelling lost them)"
    assert not any(n.startswith("sglang_") for n in names), "sglang:* names arrived as sglang_*"


def _empty_panels(live, dashboard: str) -> list[str]:
    c = live.prom.client
    dash = promstack.load_dashboards()[dashboard]
    # what Grafana offers, narrowed to the first replica (the filters are exercised) and this model
    variables = promstack.resolve_variables(dash, c)
    assert live.config["model"]["served_name"] in variables["model"]
    chosen = {"model": [live.config["model"]["served_name"]]}
    if "instance" in variables:
        instance = live.fleet.replica_urls[0].removeprefix("http://")
        assert instance in variables["instance"]
        chosen["instance"] = [instance]
    variables = chosen
    start = live.load.start - 2
    empty = []
    for q in promstack.panel_queries(dashboard, dash):
        expr = promstack.substitute(q.expr, variables, rate_interval="5s", range_=f"{int(live.end - start)}s",
                                    interval="1s")
        result = c.query(expr, live.end) if q.instant else c.query_range(expr, start, live.end, 1)
        if not promstack.finite_points(result):
            empty.append(f"{q.panel} [{q.ref}]: {expr}")
    return empty


def test_every_serving_panel_has_data(live):
    empty = _empty_panels(live, "serving")
    assert not empty, "panels without data:\n" + "\n".join(empty)


def test_every_dflash_panel_has_data(live):
    """Needs the DFLASH_ADAPTIVE worker's dflash_* metrics (docs/ARCHITECTURE.md §4)."""
    empty = _empty_panels(live, "dflash")
    assert not empty, "panels without data:\n" + "\n".join(empty)


def test_every_fleet_panel_has_data(live):
    """Per-replica and fleet totals from the replicas, health and traffic from the router."""
    empty = _empty_panels(live, "fleet")
    assert not empty, "panels without data:\n" + "\n".join(empty)


def test_router_sees_both_replicas_and_prometheus_each_ones_requests(live):
    """(How the router splits this short, prefix-sharing load between them is its cache-aware policy's call: often
    all on one. tests/integration/test_fleet.py checks both serve under Locust's varied prompts.)"""
    c = live.prom.client
    health = {s["metric"]["worker"]: s["value"][1] for s in c.query("smg_worker_health")}
    assert health == {u: "1" for u in live.fleet.replica_urls}
    served = {s["metric"]["replica"]: float(s["value"][1])
              for s in c.query('sum by (replica) (sglang:num_requests_total{job="dflash-serve"})')}
    assert set(served) == {str(i) for i in range(REPLICAS)} and sum(served.values()) >= live.load.requests, served


def test_rules_evaluate_and_record(live):
    c = live.prom.client
    without = []
    for g in c.rules():
        for r in g["rules"]:
            assert r["health"] == "ok", (r["name"], r.get("lastError"))
            if r["type"] == "recording" and not c.query(r["name"]):
                without.append(r["name"])
            if r["type"] == "alerting":
                assert r["state"] != "firing", r
    assert not without, f"recording rules without data: {without}"


def test_dashboard_metrics_exist_on_the_server(live):
    names = set(live.prom.client.label_values("__name__"))
    for name, dash in promstack.load_dashboards().items():
        for q in promstack.panel_queries(name, dash):
            for metric in promstack.metric_names(q.expr):
                if metric.startswith(("sglang:", "smg_")):
                    assert metric in names or base_name(metric) + "_bucket" in names, (q.panel, metric)


def test_render_dashboards(live, tmp_path):
    report = render_dashboards.render_all(live.prom.client, tmp_path, live.load.start - 2, live.end,
                                          rate_interval="5s", step=1)
    assert set(report) == {"serving", "dflash", "fleet", "learning"}
    for name in report:
        png = tmp_path / f"dashboard-{name}.png"
        assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert all(report["serving"].values()), report["serving"]
