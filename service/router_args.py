"""sglang-router's command line for a fleet, checked by the router's own parser.

The fleet owns the flags that tie the router to the replicas and to the config (its address, the worker URLs,
the policy and metrics port of `fleet.router`, the drain time); everything else passes through
`fleet.router.args`, validated like `sglang_args`.
"""
from __future__ import annotations

import argparse
import functools
import sys
from typing import Any

from service.config import ServeConfig
from service.sglang_args import check_flags, to_argv

# flag -> the config field that sets it
OWNED = {
    "host": "server.host", "port": "server.port (or `fleet --port`)", "worker_urls": "fleet.replicas",
    "policy": "fleet.router.policy", "prometheus_port": "fleet.router.metrics_port",
    "prometheus_host": "server.host", "api_key": "server.api_key_env",
    "control_plane_api_keys": "server.admin_api_key_env",
    "shutdown_grace_period_secs": "server.shutdown_grace_seconds",
    "worker_startup_timeout_secs": "fleet.startup_timeout_seconds",
}

# Defaults that differ from the router's own (measured with a replica killed under load, tests/integration/
# test_fleet.py). Cache-aware routing retries a failed request on the replica whose cache matches it, i.e. the
# dead one again: all 6 attempts (1 + 5 retries) of a request hit it until the circuit breaker opens after
# `cb_failure_threshold` failures. The breaker is left at the router's 10: it also counts every 4xx a replica
# answers as that replica's failure, and at 3 a few malformed bodies in a row took a healthy replica out of
# rotation for the breaker's 20 s -- with the other replica down, every client got 503 "no available workers"
# (loadtest/fleet_soak.py, docs/RELIABILITY.md). Its health check runs every 60 s (3 failures to mark a worker
# down, 2 successes to bring it back), so a restarted replica waited minutes to rejoin; 10 s bounds it, as does
# the breaker's 20-s re-trial. Its
# per-request INFO lines would drown the replicas' logs in the fleet's output. The fleet starts the router before
# the replicas (it holds its port from the start; clients get 503 rather than a refused connection while the
# models load), and the router checks every 30 s whether a worker it waits for is up: 1 s makes it ready with them.
DEFAULTS: dict[str, Any] = {"health_check_interval_secs": 10, "cb_timeout_duration_secs": 20,
                            "worker_startup_check_interval": 1, "log_level": "warn"}


@functools.lru_cache(maxsize=1)
def router_parser() -> argparse.ArgumentParser:
    """sglang-router's real parser (the `sglang-router` package; imports in well under a second)."""
    try:
        from sglang_router.router_args import RouterArgs
    except ImportError:
        from service.config import ConfigError

        raise ConfigError("fleet: the sglang-router package is not installed; `pip install sglang-router` "
                          "(scripts/install-cpu.sh installs it)") from None
    parser = argparse.ArgumentParser(prog="sglang-router", add_help=False, exit_on_error=False)
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    return parser


def validate(config: ServeConfig) -> None:
    check_flags(config.fleet.router.args, router_parser(), section="fleet.router.args", command="sglang-router",
                owned=OWNED, base_argv=[])


def command() -> list[str]:
    # = `python -m sglang_router.launch_router`, with the replicas' API key from the environment.
    return [sys.executable, "-m", "service.router_entry"]


def build_argv(config: ServeConfig, *, port: int, worker_urls: list[str]) -> list[str]:
    router = config.fleet.router
    owned: dict[str, Any] = {
        "host": config.server.host, "port": port, "worker_urls": worker_urls, "policy": router.policy,
        "prometheus_host": config.server.host, "prometheus_port": router.metrics_port,
        # The router drains its in-flight requests as long as the replicas drain theirs.
        "shutdown_grace_period_secs": max(1, round(config.server.shutdown_grace_seconds)),
        # and waits for them as long as the fleet does
        "worker_startup_timeout_secs": max(1, round(config.fleet.startup_timeout_seconds)),
    }
    return command() + to_argv(owned | {k: v for k, v in DEFAULTS.items() if k not in router.args} | router.args)
