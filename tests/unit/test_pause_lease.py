"""sglang_ext/patches/pause_lease.py's lease, on a real event loop without a server: a pause (or weight-update
session) nobody renews is ended once, after the lease; calls renew it, and a call in flight holds it however long it
takes. The served path (a learner SIGKILLed mid-swap): tests/integration/test_learning.py."""
from __future__ import annotations

import asyncio
import time

from sglang_ext.patches.pause_lease import Lease

SECONDS = 0.3


def _lease() -> tuple[Lease, list[float]]:
    ended: list[float] = []

    async def expire() -> None:
        ended.append(time.monotonic())
        lease.paused = lease.session = False  # what the server's expiry does: end the session, resume

    lease = Lease(SECONDS, expire)
    return lease, ended


async def _pause(lease: Lease) -> float:
    async with lease.call():
        lease.paused = True
    return time.monotonic()


def test_a_pause_nobody_renews_ends_once_after_the_lease():
    async def run() -> None:
        lease, ended = _lease()
        paused = await _pause(lease)
        await asyncio.sleep(SECONDS * 4)
        assert len(ended) == 1 and ended[0] - paused >= SECONDS
        assert not lease.held

    asyncio.run(run())


def test_calls_renew_the_lease_and_a_call_in_flight_holds_it():
    async def run() -> None:
        lease, ended = _lease()
        await _pause(lease)
        for _ in range(6):  # a client pushing chunk after chunk, for twice the lease
            await asyncio.sleep(SECONDS / 3)
            async with lease.call():
                pass
        async with lease.call():  # one call that takes three leases (a slow upload, a long load)
            await asyncio.sleep(SECONDS * 3)
        assert ended == [] and lease.held
        returned = time.monotonic()
        await asyncio.sleep(SECONDS * 4)
        assert len(ended) == 1 and ended[0] - returned >= SECONDS

    asyncio.run(run())


def test_nothing_held_nothing_ended():
    async def run() -> None:
        lease, ended = _lease()
        await _pause(lease)
        async with lease.call():  # /continue_generation
            lease.paused = False
        await asyncio.sleep(SECONDS * 3)
        assert ended == []

    asyncio.run(run())
