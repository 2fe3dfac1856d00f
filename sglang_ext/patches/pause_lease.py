"""A pause or weight-update session whose client is gone ends by itself (all devices; dflash-serve only).

Patches (0.5.23): `managers/tokenizer_manager.TokenizerManager.pause_generation`, `continue_generation`, and the
`begin_weight_update`, `update_weights_from_tensor` and `end_weight_update` it inherits from
`tokenizer_control_mixin.TokenizerControlMixin`. Why: the learner's hot swap (dflash_models/learn/swap.py) pauses
generation, opens a draft weight-update session, loads the drafter in chunks, ends the session and resumes, each a
separate admin call; it resumes in a `finally`, which a learner killed (SIGKILL, OOM, a lost machine) never runs.
Upstream then stays paused for good -- new requests wait in the tokenizer manager, running ones in the scheduler --
with half a drafter loaded, and every later push is refused ("a weight-update session is already open").

Here a pause or an open session is a lease, renewed by every pause and weight-update call (at its start and end;
none expires while a call is in flight). After `server.pause_lease_seconds` without one, the server takes the
client for gone: it ends an open session with the rid names.ROLLBACK_RID (the scheduler then restores the draft
weights the session began with: patches/drafter_swap.py), puts back the weight version the session began with, and
resumes generation. A later call of the dead session's client is refused by upstream (no session open) with this
said. The learner's state still names the drafter that served before the push, which is again what serves.
Retired by: upstream bounding a pause and a weight-update session by a lease or tying them to a connection.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from types import ModuleType

from sglang_ext.names import ROLLBACK_RID
from sglang_ext.patches.wrap import when_imported, wrap
from sglang_ext.settings import HttpSettings

logger = logging.getLogger(__name__)
TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager"


class Lease:
    """The lease of one tokenizer manager's pause and weight-update session (asyncio, its event loop).

    `call()` wraps each pause or weight-update call: it renews the lease at the call's start and end and holds it
    while the call runs. While `paused` or `session` holds, a watcher awaits `expire()` once `seconds` have passed
    since the last renewal with no call in flight; `expire` is expected to end what it holds (the calls it makes go
    through `call()` like any other)."""

    def __init__(self, seconds: float, expire: Callable[[], Awaitable[None]]) -> None:
        self.seconds = seconds
        self._expire = expire
        self.paused = False  # /pause_generation was called, /continue_generation not yet
        self.session = False  # a weight-update session is open
        self.version: str | None = None  # the weight version when the open session began
        self.expired_at: float | None = None  # when the lease last ended a pause or session for a gone client
        self.in_flight = 0
        self.deadline = 0.0
        self._watcher: asyncio.Task | None = None

    @property
    def held(self) -> bool:
        return self.paused or self.session

    def _renew(self) -> None:
        self.deadline = time.monotonic() + self.seconds

    @contextlib.asynccontextmanager
    async def call(self):
        self.in_flight += 1
        self._renew()
        try:
            yield
        finally:
            self.in_flight -= 1
            self._renew()
            if self.held and (self._watcher is None or self._watcher.done()):
                self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while self.held:
            left = self.deadline - time.monotonic()
            if left > 0 or self.in_flight:
                await asyncio.sleep(max(left, 0.05))
                continue
            self.expired_at = time.monotonic()
            try:
                await self._expire()
            except Exception:  # the server goes on; the next expiry tries again
                logger.exception("dflash-serve: ending an abandoned pause or weight-update session failed")
            self._renew()


def _expire(tm, lease: Lease) -> Callable[[], Awaitable[None]]:
    async def expire() -> None:
        from sglang.srt.managers.io_struct import (
            ContinueGenerationReqInput,
            EndWeightUpdateReqInput,
            UpdateWeightVersionReqInput,
        )

        held = " and ".join(x for x, on in (("a weight-update session", lease.session),
                                            ("a pause", lease.paused)) if on)
        logger.error("dflash-serve: %s held with no pause or weight-update call for %.0f s "
                     "(server.pause_lease_seconds): its client is gone; ending it: an open draft update rolled back, "
                     "generation resumed. A learner killed mid-swap: its drafter is not loaded; run the round again",
                     held, lease.seconds)
        if lease.session:
            ok, message = await tm.end_weight_update(EndWeightUpdateReqInput(rid=ROLLBACK_RID))
            if not ok:
                logger.error("dflash-serve: ending the abandoned weight-update session: %s", message)
            version = lease.version
            if version is not None and tm.config_value("weight_version") != version:
                await tm.update_weight_version(UpdateWeightVersionReqInput(new_version=version,
                                                                           abort_all_requests=False))
            lease.session = False  # ended, or not open in the scheduler: nothing of it to wait for
        if lease.paused:
            await tm.continue_generation(ContinueGenerationReqInput())

    return expire


_LEASES: dict[int, Lease] = {}  # id(tokenizer manager) -> its lease


def _lease(tm, seconds: float) -> Lease:
    lease = _LEASES.get(id(tm))
    if lease is None:
        lease = _LEASES[id(tm)] = Lease(seconds, lambda: _expire(tm, lease)())
    return lease


def _said(lease: Lease, ok: bool, message: str) -> str:
    """A weight-update call refused after the lease ended its client's session says so."""
    if ok or lease.expired_at is None or lease.session:
        return message
    ago = time.monotonic() - lease.expired_at
    return (f"{message} (dflash-serve ended the last weight-update session {ago:.0f} s ago and rolled its draft "
            f"weights back: no pause or weight-update call came for server.pause_lease_seconds, "
            f"{lease.seconds:.0f} s; begin the update again, with no gap that long between calls)")


def _patch(tm_module: ModuleType, seconds: float) -> None:
    cls = tm_module.TokenizerManager

    def make_pause(original):
        async def pause_generation(self, obj):
            lease = _lease(self, seconds)
            async with lease.call():
                out = await original(self, obj)
                lease.paused = True
            return out

        return pause_generation

    def make_continue(original):
        async def continue_generation(self, obj):
            lease = _lease(self, seconds)
            async with lease.call():
                out = await original(self, obj)
                lease.paused = False
            return out

        return continue_generation

    def make_begin(original):
        async def begin_weight_update(self, obj, request=None):
            lease = _lease(self, seconds)
            async with lease.call():
                version = self.config_value("weight_version")
                ok, message = await original(self, obj, request)
                if ok:
                    lease.session, lease.version, lease.expired_at = True, version, None
            return ok, message

        return begin_weight_update

    def make_update(original):
        async def update_weights_from_tensor(self, obj, request=None):
            lease = _lease(self, seconds)
            async with lease.call():
                ok, message = await original(self, obj, request)
            return ok, _said(lease, ok, message)

        return update_weights_from_tensor

    def make_end(original):
        async def end_weight_update(self, obj, request=None):
            lease = _lease(self, seconds)
            async with lease.call():
                ok, message = await original(self, obj, request)
                if ok:
                    lease.session = False
            return ok, _said(lease, ok, message)

        return end_weight_update

    wrap(cls, "pause_generation", make_pause)
    wrap(cls, "continue_generation", make_continue)
    wrap(cls, "begin_weight_update", make_begin)
    wrap(cls, "update_weights_from_tensor", make_update)
    wrap(cls, "end_weight_update", make_end)


def install(environ: Mapping[str, str] = os.environ) -> bool:
    settings = HttpSettings.from_env(environ)
    if settings is None or settings.pause_lease_seconds is None:
        return False
    when_imported(TOKENIZER_MANAGER, lambda m: _patch(m, settings.pause_lease_seconds))
    return True
