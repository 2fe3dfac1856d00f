"""Shut down as soon as the drain is over, not on the next 5-second tick (all devices).

SGLang 0.5.23 (managers/tokenizer_manager.py `TokenizerManager.sigterm_watchdog`) looks for the SIGTERM flag every
5 s and, once set, for the last in-flight request every 5 s. A server with nothing in flight therefore took up to a
tick to begin exiting after SIGTERM, and a drain whose last request ended just after a tick waited up to 5 s more:
time a rolling restart spends refusing traffic for nothing.
This waits for the same two conditions at a 0.1 s poll, logging the drain's progress every 5 s as upstream does,
then hands over to upstream's watchdog, which then finds both already true and runs its own exit path unchanged
(health-failed and SGL_FORCE_SHUTDOWN exits included: the wait stops early for either).

Retire when upstream's watchdog waits on an event or polls faster.
"""
from __future__ import annotations

import asyncio
import logging
import time
from types import ModuleType

from sglang_ext.patches.wrap import when_imported, wrap

POLL_SECONDS = 0.1
PROGRESS_SECONDS = 5.0  # upstream's log cadence while requests drain

logger = logging.getLogger(__name__)


def _patch(tm: ModuleType) -> None:
    def force_exit(self) -> bool:
        return self.server_status == tm.ServerStatus.UnHealthy or tm.get_bool_env_var("SGL_FORCE_SHUTDOWN")

    def make(original):
        async def sigterm_watchdog(self):
            while not self.gracefully_exit:
                await asyncio.sleep(POLL_SECONDS)
            logged = 0.0
            while self.rid_to_state and not force_exit(self):
                if time.monotonic() - logged >= PROGRESS_SECONDS:
                    logger.info("Draining after SIGTERM: %d request(s) in flight", len(self.rid_to_state))
                    logged = time.monotonic()
                await asyncio.sleep(POLL_SECONDS)
            await original(self)

        return sigterm_watchdog

    wrap(tm.TokenizerManager, "sigterm_watchdog", make)


def install() -> None:
    when_imported("sglang.srt.managers.tokenizer_manager", _patch)
