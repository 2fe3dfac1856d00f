"""Start `sglang serve` for a validated config, with the plugin, environment and arguments.

The launcher stays in the foreground as the server's parent: it forwards SIGTERM/SIGINT to
the server (which finishes in-flight requests and refuses new ones with 503), kills the server's
process group if it is still draining after `server.shutdown_grace_seconds` (and whatever remains of
that group once the server's main process has exited), and exits with the server's status (137 after
such a kill).
"""
from __future__ import annotations

import errno
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from service import models, preflight, sglang_args
from sglang_ext import names as env_names
from sglang_ext.settings import CaptureSettings, HttpSettings
from service.config import ConfigError, Device, ServeConfig

@dataclass(frozen=True)
class LaunchPlan:
    argv: list[str]
    env: dict[str, str]
    report: preflight.PreflightReport
    config: ServeConfig | None = None  # the config served: every model a folder (service/models.py)
    model_notes: tuple[str, ...] = ()  # where each model came from, for `dflash-serve check`

    def printable(self) -> str:
        return shlex.join(self.argv)


def _sglang_command() -> list[str]:
    # = `sglang serve`, but the API key comes from the environment, never the command line, and the config's
    # sglang_args are checked there (service/server_entry.py).
    return [sys.executable, "-m", "service.server_entry"]


def activate_cpu_layer_here() -> None:
    """Importing sglang in *this* process (`check`, `fleet`: to validate sglang_args) needs the CPU stubs too."""
    os.environ[env_names.CPU] = "1"
    from sglang_ext.cpu import startup

    startup.install()


def server_env(config: ServeConfig, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    if config.server.device is Device.cpu:
        threads = str(config.server.resolved_cpu_threads())
        env |= {env_names.CPU: "1", env_names.SGLANG_CPU_ENGINE: "1", env_names.OMP_THREADS: threads}
        if config.model.dtype == "float32":
            env.setdefault(env_names.SGLANG_MAMBA_CONV_DTYPE, "float32")
    else:
        env.pop(env_names.CPU, None)
    env.pop(env_names.ADAPTIVE, None)
    env.pop(env_names.SGLANG_ARGS, None)  # only this config's, set by plan()
    env[env_names.HTTP] = HttpSettings(max_request_bytes=config.server.max_request_bytes,
                                       scheduler_stopping_routes=config.server.scheduler_stopping_routes,
                                       pause_lease_seconds=config.server.pause_lease_seconds).to_json()
    env.pop(env_names.CAPTURE, None)
    if config.learning.enabled:
        env[env_names.CAPTURE] = capture_settings(config).to_json()
    if config.speculative.algorithm == "dflash_adaptive":
        env[env_names.ADAPTIVE] = config.speculative.adaptive_settings().to_json()
        if config.server.device is not Device.cpu:  # per-width verify graphs: size the KV pool after capture
            env.setdefault(env_names.SGLANG_POST_CAPTURE_KV_SIZING, "1")
    return env


def capture_settings(config: ServeConfig) -> CaptureSettings:
    """The servers' capture store from the `learning:` section (validated: enabled means store_dir is set)."""
    lr = config.learning
    total = lr.max_store_mb * 1024 * 1024
    return CaptureSettings(store_dir=str(lr.store_dir), max_store_bytes=total,
                           max_age_seconds=lr.max_age_hours * 3600.0,
                           segment_bytes=max(64 * 1024, min(4 * 1024 * 1024, total // 8)))


def check_port_free(host: str, port: int, field: str = "server.port") -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        # As uvicorn binds: a port whose last server just exited (connections in TIME_WAIT) is free to
        # reuse; without this a restart was refused for up to a minute. A listening socket still refuses.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(f"{field}: {host}:{port} is already in use (another server running?); "
                                  f"choose another port or stop that server") from None
            raise ConfigError(f"server.host: cannot bind {host}:{port}: {e.strerror}") from None


def _key_from_env(field: str, name: str | None) -> str | None:
    if name is None:
        return None
    key = os.environ.get(name)
    if not key:
        raise ConfigError(f"{field}: environment variable {name} is not set or empty")
    return key


def resolve_api_key(config: ServeConfig) -> str | None:
    return _key_from_env("server.api_key_env", config.server.api_key_env)


def resolve_admin_api_key(config: ServeConfig) -> str | None:
    """The admin key, checked to be a key of its own: one equal to the client key would make every client an
    admin again."""
    key = _key_from_env("server.admin_api_key_env", config.server.admin_api_key_env)
    if key is not None and key == resolve_api_key(config):
        raise ConfigError(f"server.admin_api_key_env: {config.server.admin_api_key_env} holds the same key as "
                          f"{config.server.api_key_env} (server.api_key_env); give the admin a different key")
    return key


def key_env(config: ServeConfig) -> dict[str, str]:
    """The keys' environment for the server and the router processes (never their command lines)."""
    keys = {env_names.API_KEY: resolve_api_key(config), env_names.ADMIN_API_KEY: resolve_admin_api_key(config)}
    return {name: key for name, key in keys.items() if key}


def with_node_rank(config: ServeConfig, rank: int) -> ServeConfig:
    """This node's config in SGLang's multi-node tensor parallelism (`sglang_args.nnodes` nodes, one config):
    only the rank differs between nodes, so it comes from the command line (`serve --node-rank`)."""
    nnodes = sglang_args.number(config.sglang_args, "nnodes", 1)
    if nnodes < 2:
        raise ConfigError("--node-rank: needs sglang_args.nnodes >= 2 (and dist_init_addr) in the config")
    if not 0 <= rank < nnodes:
        raise ConfigError(f"--node-rank: {rank} is not in 0..{nnodes - 1} (sglang_args.nnodes is {nnodes})")
    if "node_rank" in config.sglang_args:
        raise ConfigError("sglang_args.node_rank: set it with `serve --node-rank`, not in the config shared by "
                          "all nodes")
    return config.model_copy(update={"sglang_args": {**config.sglang_args, "node_rank": rank}})


def resolve_models(config: ServeConfig, *, download: bool = True) -> tuple[ServeConfig, list[str]]:
    """Every model of the config as a folder: a Hugging Face id from the local cache, downloaded where
    `model.download` allows it and `download` (False: `check`, a dry run) does too. ConfigError naming the field."""
    try:
        return models.resolve(config, download=download)
    except models.ModelsError as e:
        raise ConfigError(str(e)) from None


def plan(config: ServeConfig, *, validate_sglang_args: bool = True, download: bool = True) -> LaunchPlan:
    """Models resolved, preflight, argument building. Raises ConfigError naming the field.

    `validate_sglang_args`: check the config's sglang_args against SGLang's parser here (imports SGLang: slow).
    The server process checks them again in any case before it starts (service/server_entry.py), so `serve`
    passes False and a bad one still fails with its config error, without a second import. `download`: see
    resolve_models."""
    config, notes = resolve_models(config, download=download)
    report = preflight.check(config)
    keys = key_env(config)
    if validate_sglang_args and config.sglang_args:
        if config.server.device is Device.cpu:
            activate_cpu_layer_here()
        sglang_args.validate_passthrough(config.sglang_args)
    args = sglang_args.build_args(config, block_size=report.block_size)
    argv = _sglang_command() + ["serve"] + sglang_args.to_argv(args)
    env = server_env(config) | keys
    if config.sglang_args:
        env[env_names.SGLANG_ARGS] = json.dumps(config.sglang_args)
    return LaunchPlan(argv=argv, env=env, report=report, config=config, model_notes=tuple(notes))


def run(launch: LaunchPlan, config: ServeConfig) -> int:
    config = launch.config or config
    check_port_free(config.server.host, config.server.port)
    if config.server.cpu_cores:
        os.sched_setaffinity(0, config.server.cpu_cores)  # the server's processes inherit it
    print(f"dflash-serve: starting {launch.printable()}", file=sys.stderr, flush=True)
    # Own process group: a terminal's Ctrl-C reaches us once, and we forward it once.
    child = subprocess.Popen(launch.argv, env=launch.env, start_new_session=True)
    return supervise(child, config.server.shutdown_grace_seconds)


KILLED_STATUS = 128 + signal.SIGKILL


def supervise(child: subprocess.Popen, grace_seconds: float) -> int:
    """Wait for `child` (a process-group leader), forwarding SIGTERM/SIGINT; once signalled, give it
    `grace_seconds` to drain, then SIGKILL its whole group (SGLang's scheduler and detokenizer too)."""
    deadline: list[float] = []

    def forward(signum, _frame):
        if child.poll() is None:
            child.send_signal(signum)
            if not deadline:
                deadline.append(time.monotonic() + grace_seconds)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    while True:
        try:
            status = child.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
        else:
            # SGLang's own processes outlive its main one when a stop signal lands mid-start (seen: a
            # detokenizer and a server process left running); the group is the server's, so none may remain.
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            return status
        if deadline and time.monotonic() > deadline[0]:
            print(f"dflash-serve: server still draining {grace_seconds:g}s after the stop signal "
                  f"(server.shutdown_grace_seconds); killing it", file=sys.stderr, flush=True)
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            child.wait()
            return KILLED_STATUS
