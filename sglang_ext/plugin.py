"""SGLang plugin entry point (`sglang.srt.plugins` group): `register()`.

SGLang calls `register()` in every process it starts (engine, scheduler, detokenizer) via
`sglang.srt.plugins.load_plugins()`. It must be idempotent and cheap. Nothing happens at
import time; prometheus metrics are created lazily in the scheduler (see metrics.py).
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)
_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    _registered = True
    from sglang_ext import cpu, dflash_headroom, http_guard, idle_metrics, redaction, request_validation, spec_algo

    redaction.install()
    request_validation.install()
    dflash_headroom.install()
    idle_metrics.install()
    http_guard.install()  # only under dflash-serve (DFLASH_SERVE_HTTP set by the launcher)
    spec_algo.install()

    if cpu.is_active():
        from sglang_ext.cpu import patches

        applied = patches.install()
        logger.info("dflash-serve CPU layer active: %s", ", ".join(applied))
