"""SGLang plugin entry point (`sglang.srt.plugins` group): `register()`.

SGLang calls `register()` in every process it starts (engine, scheduler, detokenizer) via
`sglang.srt.plugins.load_plugins()`. It must be idempotent and cheap. Nothing happens at
import time; prometheus metrics are created lazily in the scheduler (see metrics.py).

Order matters: the algorithm is registered before the patches, because in the scheduler process the patched
modules are already imported and the name-site patches look DFLASH_ADAPTIVE up at once.
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
    from sglang_ext import cpu, patches, spec_algo

    spec_algo.install()
    applied = patches.install(cpu_active=cpu.is_active())
    logger.debug("dflash-serve patches applied: %s", ", ".join(applied))
    if cpu.is_active():
        from sglang_ext.patches import cpu_layer

        logger.info("dflash-serve CPU layer active: %s", ", ".join(cpu_layer.install()))
