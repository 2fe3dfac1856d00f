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

# Defaults that differ from the router's own (measured with a replica killed under load and clients sending bad
# bodies: tests/integration/test_fleet.py, loadtest/fleet_soak.py, docs/RELIABILITY.md).
# - The circuit breaker is off. sglang-router 0.3.2 records every non-2xx answer as the replica's failure
#   (`routers/http/router.rs`: `record_outcome(status.is_success())`), so clients' malformed or over-long bodies --
#   a replica's 400s -- open a healthy replica's breaker, and in half-open one 4xx re-opens it: with the other
#   replica down, every client got 503 "no available workers" for minutes (docs/BENCHMARKS.md, fleet fault soak).
#   Upstream's fix (sgl-project/sglang#39464, a cleanly answered 4xx counts as success) is in no sglang-router
#   release installable here; set `cb_*` and `disable_circuit_breaker: false` in `fleet.router.args` once it is.
# - A dead replica is found by the health check instead: SGLang's `/health` answers at once without generating, so
#   checking every second is cheap, and two failed checks (a refused connection) take the replica out of rotation
#   within ~2 s; one success brings a restarted replica back.
# - Retries outlast that detection: cache-aware routing sends a request's retries to the replica whose cache
#   matches it -- the dead one, until it is out of rotation -- and the router makes `retry_max_retries` (5)
#   attempts in all, so backoffs starting at 0.3 s and doubling outlast the detection and reach a live replica.
#   Only the requests a replica was running when it died fail.
# - Its per-request INFO lines would drown the replicas' logs in the fleet's output. The fleet starts the router
#   before the replicas (it holds its port from the start; clients get 503 rather than a refused connection while
#   the models load), and the router checks every 30 s whether a worker it waits for is up: 1 s makes it ready with
#   them.
DEFAULTS: dict[str, Any] = {"disable_circuit_breaker": True, "health_check_interval_secs": 1,
                            "health_failure_threshold": 2, "health_success_threshold": 1,
                            "retry_initial_backoff_ms": 300, "retry_backoff_multiplier": 2.0,
                            "worker_startup_check_interval": 1, "log_level": "warn"}

# On GPU, besides: cache-aware routing balances only once one replica holds both `balance_abs_threshold` more
# requests than the least loaded and `balance_rel_threshold` times as many (the router's defaults: 64 and 1.5).
# Short chat prompts share their chat template's prefix, so below that every one of them goes to the replica that
# served the first: on CPU, where replicas split one machine's cores, that costs little (and spreading costs the
# cores' shared caches: docs/BENCHMARKS.md#fleet-routing-balance); on GPUs each replica has an accelerator of its
# own, and one left idle is capacity lost. With these, loads stay within a few requests of each other and the
# cache decides among replicas about as loaded.
GPU_DEFAULTS: dict[str, Any] = {"balance_abs_threshold": 2, "balance_rel_threshold": 1.2}


def defaults(config: ServeConfig) -> dict[str, Any]:
    """The fleet's router defaults for this config (the config's own `fleet.router.args` override them)."""
    return DEFAULTS | (GPU_DEFAULTS if config.server.device.value == "cuda" else {})


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
    return command() + to_argv(owned | {k: v for k, v in defaults(config).items() if k not in router.args}
                               | router.args)
