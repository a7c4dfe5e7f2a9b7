"""The agentless SGLang poller keeps watching through surprises from its HTTP client: a cancellation
nobody asked for (aiohttp's timeouts leave the awaiting task's cancellation count raised) and an
unexpected exception each cost one poll, never the watcher. A real stand-in server; the fault sits at
the seam, in the HTTP session the poller is given."""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

import aiohttp

from gateway.server.workers.monitor import LoadMonitor
from gateway.server.workers.sglang import SGLangPoller, SGLangTarget
from tests.fixtures.sglang_standin import start_standin


class FlakySession:
    """A client session whose next GETs raise the queued surprises, then behave."""

    def __init__(self) -> None:
        self.real = aiohttp.ClientSession()
        self.surprises: list[BaseException] = []
        self.raised = 0

    def get(self, *args: Any, **kwargs: Any) -> Any:
        if self.surprises:
            self.raised += 1
            raise self.surprises.pop(0)
        return self.real.get(*args, **kwargs)

    async def close(self) -> None:
        await self.real.close()


async def test_the_poller_survives_a_stray_cancellation_and_an_unexpected_error() -> None:
    server = await start_standin()
    monitor = LoadMonitor(clock=time.monotonic, heartbeat_interval_s=0.05, heartbeat_misses=3)
    http = FlakySession()
    poller = SGLangPoller(
        monitor, cast(aiohttp.ClientSession, http), [SGLangTarget("sg0", server.url)], poll_interval_s=0.02, misses=3
    )
    poller.start()
    try:
        async with asyncio.timeout(10):
            while "sg0" not in monitor.workers:
                await asyncio.sleep(0.01)
            rec = monitor.workers["sg0"]
            http.surprises = [asyncio.CancelledError(), RuntimeError("surprise"), asyncio.CancelledError()]
            while http.surprises:
                await asyncio.sleep(0.01)
            after = rec.heartbeats
            while rec.heartbeats < after + 3:  # still polled, still the same incarnation
                await asyncio.sleep(0.01)
        assert http.raised == 3
        assert monitor.workers["sg0"] is rec
        assert all(not t.done() for t in poller._tasks)
    finally:
        await poller.stop()
        await http.close()
        await server.stop()


async def test_stop_still_stops_the_watchers() -> None:
    server = await start_standin()
    monitor = LoadMonitor(clock=time.monotonic, heartbeat_interval_s=0.05, heartbeat_misses=3)
    async with aiohttp.ClientSession() as http:
        poller = SGLangPoller(
            monitor, http, [SGLangTarget("sg0", server.url)], poll_interval_s=0.02, misses=3
        )
        poller.start()
        tasks = list(poller._tasks)
        async with asyncio.timeout(10):
            while "sg0" not in monitor.workers:
                await asyncio.sleep(0.01)
        await poller.stop()
        assert all(t.done() for t in tasks) and not poller._tasks
    await server.stop()
