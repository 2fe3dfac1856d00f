"""Turn a ServeConfig into `sglang serve` arguments, checked by SGLang's own parser."""
from __future__ import annotations

import argparse
import functools
import json
import math
from typing import Any

from service.config import ConfigError, Device, ServeConfig

# Flags the structured config owns: setting them in sglang_args would fight the config.
_OWNED = {
    "model_path", "tokenizer_path", "dtype", "served_model_name", "context_length", "host", "port", "device",
    "api_key", "admin_api_key", "enable_metrics", "max_total_tokens", "max_running_requests",
    "speculative_algorithm", "speculative_draft_model_path", "speculative_num_draft_tokens",
    "speculative_dflash_block_size",
}
_CONFIG_FIELD_FOR = {
    "model_path": "model.path", "tokenizer_path": "model.tokenizer", "dtype": "model.dtype",
    "served_model_name": "model.served_name", "context_length": "model.context_length", "host": "server.host",
    "port": "server.port", "device": "server.device", "api_key": "server.api_key_env",
    "admin_api_key": "server.admin_api_key_env", "enable_metrics": "server.metrics",
    "max_total_tokens": "server.max_total_tokens", "max_running_requests": "server.max_running_requests",
}

# What SGLang needs to run on CPU: torch-native attention (no FlashInfer), no CUDA graphs, and
# no overlap scheduling (its CUDA-stream overlap buys nothing on CPU and DFlash v2 relays via it), and
# sleep_on_idle: an idle scheduler otherwise busy-polls its sockets (a core's worth of CPU while idle),
# taking a core the model needs; it waits in zmq poll instead, which wakes on the next request.
CPU_DEFAULTS = {
    "attention_backend": "torch_native",
    "disable_overlap_schedule": True,
    "cuda_graph_backend_decode": "disabled",
    "cuda_graph_backend_prefill": "disabled",
    "sleep_on_idle": True,
    # one KV pool for every layer: the CPU layer's attention (sglang_ext/cpu/attention.py) reads a sliding-window
    # layer's keys at the full pool's slots; SGLang's separate sliding-window pool would need them translated
    "disable_hybrid_swa_memory": True,
}


@functools.lru_cache(maxsize=1)
def sglang_parser() -> argparse.ArgumentParser:
    """SGLang's real `serve` parser (imports sglang: slow, so cached)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve", add_help=False, exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return parser


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def to_argv(items: dict[str, Any]) -> list[str]:
    argv: list[str] = []
    for dest, value in items.items():
        if value is None or value is False:
            continue
        if value is True:
            argv.append(_flag(dest))
        elif isinstance(value, dict):  # a JSON-valued flag (default_chat_template_kwargs, preferred_sampling_params)
            argv += [_flag(dest), json.dumps(value)]
        elif isinstance(value, (list, tuple)):
            argv += [_flag(dest), *map(str, value)]
        else:
            argv += [_flag(dest), str(value)]
    return argv


def build_args(config: ServeConfig, block_size: int | None = None) -> dict[str, Any]:
    """All server arguments by dest name, in a stable order. The API key is not among them: it travels
    by environment (service/server_entry.py) so it never appears on a command line."""
    m, s, sp = config.model, config.server, config.speculative
    args: dict[str, Any] = {
        "model_path": m.path, "tokenizer_path": m.tokenizer, "dtype": m.dtype,
        "served_model_name": m.served_name, "context_length": m.context_length,
        "host": s.host, "port": s.port, "device": s.device.value,
        "enable_metrics": s.metrics, "max_total_tokens": s.max_total_tokens,
        "max_running_requests": s.max_running_requests,
    }
    if sp.algorithm != "none":
        args |= {"speculative_algorithm": sp.algorithm.upper(), "speculative_draft_model_path": sp.draft_model_path,
                 "speculative_num_draft_tokens": block_size or sp.block_size}
    if s.device is Device.cpu:
        args |= {k: v for k, v in CPU_DEFAULTS.items() if k not in config.sglang_args}
    return args | config.sglang_args


def number(items: dict[str, Any], key: str, default: float, *, kind: type = int, minimum: float | None = None):
    """`sglang_args.<key>` as the preflight and the memory plan read it (unset, null or 0: `default`), refused with
    a ConfigError naming the field when it is not a number (SGLang's parser is not asked before they read it)."""
    raw = items.get(key) or default
    what = "an integer" if kind is int else "a number"
    try:
        if isinstance(raw, bool) or (kind is int and isinstance(raw, float) and not raw.is_integer()):
            raise ValueError
        value = kind(raw)
        if kind is float and not math.isfinite(value):
            raise ValueError
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"sglang_args.{key}: expected {what}, got {_short(raw)}") from None
    if minimum is not None and value < minimum:
        raise ConfigError(f"sglang_args.{key}: must be >= {minimum}, got {_short(raw)}")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def validate_passthrough(items: dict[str, Any], parser: argparse.ArgumentParser | None = None) -> None:
    """Every key of a config's `sglang_args` (`items`) must be a real SGLang flag not owned by the config, and its
    value must parse."""
    check_flags(items, parser or sglang_parser(), section="sglang_args", command="sglang serve",
                owned={k: _CONFIG_FIELD_FOR.get(k, "speculative") for k in _OWNED}, base_argv=["--model-path", "_"])


def check_flags(items: dict[str, Any], parser: argparse.ArgumentParser, *, section: str, command: str,
                owned: dict[str, str], base_argv: list[str]) -> None:
    """Pass-through flags (`section.<flag name>: value`) checked by the command's own argparse `parser`:
    each must exist, must not be one the config owns (`owned`: flag -> the config field to use), and its
    value must parse. Raises ConfigError naming `section.<key>`."""
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    for key, value in items.items():
        field = f"{section}.{key}"
        if key in owned:
            raise ConfigError(f"{field}: set this through `{owned[key]}` in the config, not {section}")
        action = actions.get(key.replace("-", "_"))
        if action is None:
            import difflib

            close = difflib.get_close_matches(key, list(actions), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{field}: not an `{command}` argument{hint}")
        is_flag = action.nargs == 0
        if is_flag and not isinstance(value, bool):
            raise ConfigError(f"{field}: is an on/off flag; use true or false")
        if not is_flag:
            try:
                parser.parse_args(base_argv + to_argv({action.dest: value}))
            except (argparse.ArgumentError, SystemExit) as e:
                raise ConfigError(f"{field}: invalid value {value!r}: {e}") from None
