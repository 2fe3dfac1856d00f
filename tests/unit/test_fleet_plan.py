"""`dflash-serve fleet`'s plan: what each replica and the router get, and every impossible fleet refused up front
with the field named. (The running fleet: tests/integration/test_fleet.py.)"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from service import fleet, launcher
from service.config import ConfigError, parse_config
from tests.conftest import REPO


def config(pair, **sections):
    data = {"model": {"path": str(pair["target"])},
            "speculative": {"algorithm": "dflash", "draft_model_path": str(pair["drafter"])}}
    for name, value in sections.items():
        data[name] = value
    return parse_config(data)


def plan(pair, replicas=None, port=None, **sections):
    return fleet.plan(config(pair, **sections), replicas=replicas, port=port, validate_sglang_args=False)


def argv_value(argv: list[str], flag: str) -> list[str]:
    i = argv.index(flag) + 1
    out = []
    while i < len(argv) and not argv[i].startswith("--"):
        out.append(argv[i])
        i += 1
    return out


def test_replicas_get_consecutive_ports_after_the_router(random_pair, monkeypatch):
    monkeypatch.setattr(fleet, "available_cores", lambda: [0, 1, 2, 3])
    p = plan(random_pair, replicas=2, port=31000)
    assert p.port == 31000 and [r.port for r in p.replicas] == [31001, 31002]
    assert [r.config.server.port for r in p.replicas] == [31001, 31002]
    assert argv_value(p.router_argv, "--port") == ["31000"]
    assert argv_value(p.router_argv, "--worker-urls") == ["http://127.0.0.1:31001", "http://127.0.0.1:31002"]
    p = plan(random_pair, replicas=3, fleet={"replica_base_port": 40000})
    assert [r.port for r in p.replicas] == [40000, 40001, 40002] and p.port == 30000


def test_cpu_replicas_split_the_cores_and_count_threads_on_their_share(random_pair, monkeypatch):
    monkeypatch.setattr(fleet, "available_cores", lambda: list(range(7)))
    p = plan(random_pair, replicas=2)
    assert [r.config.server.cpu_cores for r in p.replicas] == [[0, 1, 2, 3], [4, 5, 6]]
    assert [r.config.server.resolved_cpu_threads() for r in p.replicas] == [3, 2]  # one core left for HTTP
    assert all(r.env == {} for r in p.replicas)
    # the config's own cores, when it names them, are what is split
    p = plan(random_pair, replicas=2, server={"cpu_cores": [1, 0]})
    assert [r.config.server.cpu_cores for r in p.replicas] == [[1], [0]]
    assert [r.config.server.resolved_cpu_threads() for r in p.replicas] == [1, 1]


def test_more_cpu_replicas_than_cores_is_refused(random_pair, monkeypatch):
    monkeypatch.setattr(fleet, "available_cores", lambda: [0, 1])
    with pytest.raises(ConfigError, match=r"fleet.replicas: 3 CPU replicas need at least 3 cores"):
        plan(random_pair, replicas=3)


def test_gpu_replicas_get_one_device_each(random_pair):
    cfg = config(random_pair, server={"device": "cuda"}, fleet={"gpus": [2, 5, 7]})
    p = fleet.plan(cfg, replicas=2, validate_sglang_args=False)
    assert [r.env for r in p.replicas] == [{"CUDA_VISIBLE_DEVICES": "2"}, {"CUDA_VISIBLE_DEVICES": "5"}]
    assert all(r.config.server.cpu_cores is None for r in p.replicas)


def test_gpu_fleets_spread_short_prompts(random_pair, monkeypatch):
    """On GPU the router balances once one replica holds a couple of requests more than another (each replica has
    an accelerator of its own); on CPU it keeps the router's default; a config's own value wins."""
    from service.router_args import GPU_DEFAULTS

    cfg = config(random_pair, server={"device": "cuda"})
    a = fleet.plan(cfg, replicas=4, validate_sglang_args=False).router_argv
    assert argv_value(a, "--balance-abs-threshold") == [str(GPU_DEFAULTS["balance_abs_threshold"])]
    assert argv_value(a, "--balance-rel-threshold") == [str(GPU_DEFAULTS["balance_rel_threshold"])]
    from sglang_router.launch_router import parse_router_args

    parsed = parse_router_args(a[3:])
    assert (parsed.balance_abs_threshold, parsed.balance_rel_threshold) == (2, 1.2) and parsed.policy == "cache_aware"
    own = config(random_pair, server={"device": "cuda"}, fleet={"router": {"args": {"balance_abs_threshold": 8}}})
    assert argv_value(fleet.plan(own, replicas=4, validate_sglang_args=False).router_argv,
                      "--balance-abs-threshold") == ["8"]
    monkeypatch.setattr(fleet, "available_cores", lambda: [0, 1])
    assert "--balance-abs-threshold" not in plan(random_pair, replicas=2).router_argv


def test_fewer_gpus_than_replicas_is_refused(random_pair):
    cfg = config(random_pair, server={"device": "cuda"}, fleet={"gpus": [0]})
    with pytest.raises(ConfigError, match=r"fleet.gpus: lists 1 GPU\(s\) for 2 replicas"):
        fleet.plan(cfg, replicas=2, validate_sglang_args=False)


@pytest.mark.parametrize("sections, kwargs, message", [
    ({"fleet": {"replica_base_port": 30000}}, {"replicas": 2}, "fleet.replica_base_port: replica ports 30000-30001 "
                                                                "include the router's port 30000"),
    ({"fleet": {"replica_base_port": 65535}}, {"replicas": 2}, "fleet.replica_base_port: 2 replicas from 65535 run"),
    ({"fleet": {"router": {"metrics_port": 30001}}}, {"replicas": 2}, "fleet.router.metrics_port: 30001 is also"),
    ({}, {"replicas": 0}, "fleet.replicas: must be >= 1"),
    ({"fleet": {"router": {"args": {"cache_treshold": 0.3}}}}, {"replicas": 1},
     "fleet.router.args.cache_treshold: not an `sglang-router` argument (did you mean 'cache_threshold'?)"),
    ({"fleet": {"router": {"args": {"worker_urls": ["http://x"]}}}}, {"replicas": 1},
     "fleet.router.args.worker_urls: set this through `fleet.replicas`"),
    ({"fleet": {"router": {"args": {"cache_threshold": "high"}}}}, {"replicas": 1},
     "fleet.router.args.cache_threshold: invalid value 'high'"),
    ({"fleet": {"router": {"args": {"dp_aware": "yes"}}}}, {"replicas": 1},
     "fleet.router.args.dp_aware: is an on/off flag"),
])
def test_impossible_fleets_name_the_field(random_pair, monkeypatch, sections, kwargs, message):
    monkeypatch.setattr(fleet, "available_cores", lambda: [0, 1])
    with pytest.raises(ConfigError) as e:
        plan(random_pair, **kwargs, **sections)
    assert message in str(e.value)


@pytest.mark.parametrize("section, message", [
    ({"router": {"policy": "least_loaded"}}, "fleet.router.policy: Input should be 'cache_aware'"),
    ({"replicas": 0}, "fleet.replicas: Input should be greater than or equal to 1"),
    ({"gpus": []}, "fleet.gpus: List should have at least 1 item"),
    ({"replica": 2}, "fleet.replica: unknown key"),
])
def test_fleet_section_is_validated_at_load(random_pair, section, message):
    with pytest.raises(ConfigError, match=message):
        config(random_pair, fleet=section)


def test_router_arguments_pass_through_and_defaults_yield_to_them(random_pair, monkeypatch):
    monkeypatch.setattr(fleet, "available_cores", lambda: [0, 1])
    p = plan(random_pair, replicas=2, fleet={"router": {"policy": "power_of_two", "metrics_port": 29100, "args": {
        "cache_threshold": 0.3, "health_check_interval_secs": 3, "disable_retries": True}}},
        server={"shutdown_grace_seconds": 42})
    a = p.router_argv
    assert a[:3] == [sys.executable, "-m", "service.router_entry"]
    assert argv_value(a, "--policy") == ["power_of_two"] and argv_value(a, "--prometheus-port") == ["29100"]
    assert argv_value(a, "--cache-threshold") == ["0.3"] and "--disable-retries" in a
    assert argv_value(a, "--health-check-interval-secs") == ["3"]  # the config's, not the fleet's default
    assert argv_value(a, "--health-failure-threshold") == ["2"]    # the fleet's defaults
    assert "--disable-circuit-breaker" in a                          # 0.3.2's breaker counts clients' 4xx
    assert argv_value(a, "--shutdown-grace-period-secs") == ["42"]  # the router drains as long as the replicas
    # started before the replicas, it waits for them as long as the fleet does, and checks every second
    assert argv_value(a, "--worker-startup-timeout-secs") == ["1800"]
    assert argv_value(a, "--worker-startup-check-interval") == ["1"]
    from sglang_router.launch_router import parse_router_args

    parsed = parse_router_args(a[3:])  # the router's own parser accepts the whole command
    assert parsed.policy == "power_of_two" and parsed.worker_urls == p.worker_urls
    assert parsed.disable_circuit_breaker and parsed.retry_initial_backoff_ms == 300


def test_no_api_key_on_any_command_line(random_pair, monkeypatch):
    monkeypatch.setattr(fleet, "available_cores", lambda: [0, 1])
    monkeypatch.setenv("MY_KEY", "sk-secret-123")
    p = plan(random_pair, replicas=2, server={"api_key_env": "MY_KEY"})
    assert "sk-secret-123" not in " ".join(p.router_argv)
    for r in p.replicas:
        assert "sk-secret-123" not in json.dumps(fleet.replica_config_dict(r))
    # the router reads it from the variable the replicas read (service/router_entry.py)
    assert launcher.plan(p.replicas[0].config, validate_sglang_args=False).env.get("DFLASH_SERVE_SGLANG_API_KEY") \
        == "sk-secret-123"


def test_replica_config_round_trips(random_pair, monkeypatch, tmp_path):
    monkeypatch.setattr(fleet, "available_cores", lambda: [0, 1])
    p = plan(random_pair, replicas=2, speculative={"algorithm": "dflash_adaptive",
                                                   "draft_model_path": str(random_pair["drafter"]),
                                                   "adaptive": {"candidates": [1, 4, 16]}})
    for r in p.replicas:
        path = tmp_path / f"{r.name}.yaml"
        path.write_text(yaml.safe_dump(fleet.replica_config_dict(r)))
        from service.config import load_config

        back = load_config(path)
        assert back.server == r.config.server and back.speculative == r.config.speculative
        assert back.model == r.config.model and back.fleet == type(back.fleet)()


def test_prometheus_targets_name_each_replica(random_pair, monkeypatch):
    monkeypatch.setattr(fleet, "available_cores", lambda: [0, 1])
    p = plan(random_pair, replicas=2, fleet={"advertise_host": "dflash-serve"})
    assert fleet.prometheus_targets(p) == [{"targets": ["dflash-serve:30001"], "labels": {"replica": "0"}},
                                           {"targets": ["dflash-serve:30002"], "labels": {"replica": "1"}}]
    p = plan(random_pair, replicas=1, server={"host": "0.0.0.0"})
    assert fleet.prometheus_targets(p)[0]["targets"][0].endswith(":30001")
    assert not fleet.prometheus_targets(p)[0]["targets"][0].startswith("0.0.0.0")


def test_cli_dry_run_prints_the_plan(random_pair, tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"model": {"path": str(random_pair["target"])}, "server": {"cpu_cores": [0]},
                                    "speculative": {"algorithm": "dflash",
                                                    "draft_model_path": str(random_pair["drafter"])}}))
    r = subprocess.run([sys.executable, "-m", "service.cli", "fleet", "-c", str(path), "-n", "1", "-p", "31500",
                        "--dry-run"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "router  :31500 (cache_aware" in r.stdout and "replica-0 :31501 cores [0] threads 1" in r.stdout
    r = subprocess.run([sys.executable, "-m", "service.cli", "fleet", "-c", str(path), "-n", "2", "--dry-run"],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2 and "fleet.replicas: 2 CPU replicas need at least 2 cores" in r.stderr


@pytest.mark.parametrize("sglang_args, rank, message", [
    ({}, 0, "--node-rank: needs sglang_args.nnodes >= 2"),
    ({"nnodes": 2, "dist_init_addr": "h:1"}, 2, "--node-rank: 2 is not in 0..1"),
    ({"nnodes": 2, "dist_init_addr": "h:1", "node_rank": 0}, 1, "sglang_args.node_rank: set it with"),
])
def test_node_rank_errors(random_pair, sglang_args, rank, message):
    cfg = config(random_pair, sglang_args=sglang_args)
    with pytest.raises(ConfigError, match=message):
        launcher.with_node_rank(cfg, rank)


def test_node_rank_reaches_sglang(random_pair):
    cfg = launcher.with_node_rank(config(random_pair, sglang_args={"nnodes": 2, "dist_init_addr": "h:5000"}), 1)
    argv = launcher.plan(cfg, validate_sglang_args=False).argv
    assert argv_value(argv, "--node-rank") == ["1"] and argv_value(argv, "--nnodes") == ["2"]
