"""Keep API keys out of SGLang's logs and answers (all devices).

SGLang 0.5.23 writes the server arguments to its log twice, redacting only watermark keys:
`ServerArgs.__repr__` (srt/server_args.py) and `server_args={...}` from
`entrypoints/engine.py _server_args_for_logging`. Both would print `api_key` / `admin_api_key`.
`GET /server_info` and `/get_server_info` answer any client with `resolved_dict()`, the launch command (whose
argv holds `--api-key`: service/server_entry.py puts it there) and every scheduler's `internal_states` (the resolved
server arguments again), passed through `redact_watermark_secrets` on the way out; a crash dump
(`TokenizerManager.dump_requests_before_crash`, with `crash_dump_folder`) pickles the ServerArgs record, the
resolved config and `sys.argv`. The names `redact_watermark_secrets` / `redact_watermark_command_line` in
`entrypoints/http_server` and `managers/tokenizer_manager`, and `TokenizerManager._server_args_for_dump`, are
wrapped to mask the keys too. Retired by upstream redacting both keys where it redacts the watermark's.

Client input out of the log: `/v1/responses` (`serving_responses.py`, "Error in preprocessing prompt inputs") and
`/v1/messages/count_tokens` (`anthropic/serving.py`, "Error converting count_tokens request") log a client's
invalid request with `logger.exception`: a traceback, and pydantic's message quoting the offending input
(`input_value=...`, prompt text included). Both answer 400 themselves; their loggers now keep the line, with the
exception's type only (found by the property-based run on every route). Retired when upstream logs those at debug.
"""
from __future__ import annotations

import logging
import re
from types import ModuleType
from typing import Any

from sglang_ext.patches.wrap import when_imported, wrap

SECRET_FIELDS = ("api_key", "admin_api_key")
MASK = "***"
_KEY_FLAG = re.compile(r"(--(?:admin-)?api-key(?:=|\s+))(\S+)")


def mask_key_flags(command: str) -> str:
    """A command line with the values of `--api-key` / `--admin-api-key` masked."""
    return _KEY_FLAG.sub(lambda m: m.group(1) + MASK, command)


def _secrets(server_args) -> list[str]:
    return [v for v in (getattr(server_args, f, None) for f in SECRET_FIELDS) if isinstance(v, str) and v]


def _patch_repr(sa: ModuleType) -> None:
    def make(original):
        def __repr__(self) -> str:
            text = original(self)
            for secret in _secrets(self):
                text = text.replace(repr(secret), repr(MASK))
            return text

        return __repr__

    wrap(sa.ServerArgs, "__repr__", make)


def _patch_engine_log(engine: ModuleType) -> None:
    def make(original):
        def _server_args_for_logging(server_args):
            shown = original(server_args)
            return {k: (MASK if k in SECRET_FIELDS and v else v) for k, v in shown.items()}

        return _server_args_for_logging

    wrap(engine, "_server_args_for_logging", make)


def masked(value: Any) -> Any:
    """`value` with every `api_key` / `admin_api_key` field and the keys in any `launch_command` masked."""
    if isinstance(value, dict):
        return {k: MASK if k in SECRET_FIELDS and v else
                mask_key_flags(v) if k == "launch_command" and isinstance(v, str) else masked(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(masked(v) for v in value)
    return value


def _mask_where_watermarks_are_redacted(module: ModuleType) -> None:
    """The module's own names of the watermark redaction functions mask the keys too."""
    def make_secrets(original):
        def redact_watermark_secrets(value, *args, **kwargs):
            return masked(original(value, *args, **kwargs))

        return redact_watermark_secrets

    def make_command(original):
        def redact_watermark_command_line(argv, *args, **kwargs) -> str:
            return mask_key_flags(original(argv, *args, **kwargs))

        return redact_watermark_command_line

    for name, make in (("redact_watermark_secrets", make_secrets), ("redact_watermark_command_line", make_command)):
        if hasattr(module, name):
            wrap(module, name, make)


def _patch_crash_dump(tm: ModuleType) -> None:
    _mask_where_watermarks_are_redacted(tm)

    def make(original):
        def _server_args_for_dump(self):
            shown = original(self)  # the ServerArgs record itself unless watermarking is on
            return masked(shown if isinstance(shown, dict) else shown.resolved_dict())

        return _server_args_for_dump

    wrap(tm.TokenizerManager, "_server_args_for_dump", make)


# upstream's lines that log a client's invalid request with its exception (everything else keeps its traceback)
INPUT_ERROR_LINES = ("Error in preprocessing prompt inputs", "Error converting count_tokens request")


class _InputErrorWithoutInput(logging.Filter):
    """A record logged with an exception about a client's request: its first phrase and the exception type."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        head = str(record.msg).split("%", 1)[0].rstrip(": ")
        if exc is not None and head in INPUT_ERROR_LINES:
            record.msg, record.args = "%s: %s (a client's invalid request; its input is not logged)", (
                head, type(exc).__name__)
            record.exc_info, record.exc_text = None, None
        return True


def _quiet_input_errors(module: ModuleType) -> None:
    log = getattr(module, "logger", None)
    if isinstance(log, logging.Logger) and not any(isinstance(f, _InputErrorWithoutInput) for f in log.filters):
        log.addFilter(_InputErrorWithoutInput())


def install() -> None:
    when_imported("sglang.srt.entrypoints.openai.serving_responses", _quiet_input_errors)
    when_imported("sglang.srt.entrypoints.anthropic.serving", _quiet_input_errors)
    when_imported("sglang.srt.server_args", _patch_repr)
    when_imported("sglang.srt.entrypoints.engine", _patch_engine_log)
    when_imported("sglang.srt.entrypoints.http_server", _mask_where_watermarks_are_redacted)
    when_imported("sglang.srt.managers.tokenizer_manager", _patch_crash_dump)
