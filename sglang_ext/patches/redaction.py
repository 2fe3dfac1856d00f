"""Keep API keys out of SGLang's logs (all devices).

SGLang 0.5.23 writes the server arguments to its log twice, redacting only watermark keys:
`ServerArgs.__repr__` (srt/server_args.py) and `server_args={...}` from
`entrypoints/engine.py _server_args_for_logging`. Both would print `api_key` / `admin_api_key`.
"""
from __future__ import annotations

from types import ModuleType

from sglang_ext.patches.wrap import when_imported, wrap

SECRET_FIELDS = ("api_key", "admin_api_key")
MASK = "***"


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


def install() -> None:
    when_imported("sglang.srt.server_args", _patch_repr)
    when_imported("sglang.srt.entrypoints.engine", _patch_engine_log)
