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


class StopAsPollEnds:
    """A client session that starts the poller's stop just as a poll's last read ends: the stop's
    cancellation reaches the watcher while its finished poll's result waits to be handed over, which
    Python 3.11's wait_for hands over and drops the cancellation."""

    def __init__(self) -> None:
        self.real = aiohttp.ClientSession()
        self.poller: SGLangPoller | None = None
        self.stop: asyncio.Task[None] | None = None

    def get(self, url: str, **kwargs: Any) -> Any:
        return _Ending(self, self.real.get(url, **kwargs), "/v1/loads" in url)


class _Ending:
    def __init__(self, owner: StopAsPollEnds, cm: Any, last: bool) -> None:
        self.owner, self.cm, self.last = owner, cm, last

    async def __aenter__(self) -> Any:
        return await self.cm.__aenter__()

    async def __aexit__(self, *exc: Any) -> None:
        await self.cm.__aexit__(*exc)
        owner = self.owner
        poller = owner.poller
        if self.last and poller is not None and owner.stop is None and "sg0" in poller.monitor.workers:
            # no await after this: the poll returns in this step, the stop's cancellation comes next
            def stop() -> None:
                owner.stop = asyncio.ensure_future(poller.stop())

            asyncio.get_running_loop().call_soon(stop)


async def test_a_stop_that_arrives_as_a_poll_ends_stops_the_watcher_at_once() -> None:
    server = await start_standin()
    monitor = LoadMonitor(clock=time.monotonic, heartbeat_interval_s=0.05, heartbeat_misses=20)
    http = StopAsPollEnds()
    # a stop waits for a watcher up to 2 x 0.05 x 20 + 1 = 3 s
    target = SGLangTarget("sg0", server.url)
    poller = SGLangPoller(
        monitor, cast(aiohttp.ClientSession, http), [target], poll_interval_s=0.05, misses=20
    )
    http.poller = poller
    poller.start()
    tasks = list(poller._tasks)
    try:
        async with asyncio.timeout(10):
            while http.stop is None:
                await asyncio.sleep(0.01)
        t0 = time.monotonic()
        await http.stop
        assert time.monotonic() - t0 < 1.0  # a poll interval or two, not the 3 s bound
        assert all(t.done() for t in tasks) and not poller._tasks
    finally:
        await poller.stop()
        await http.real.close()
        await server.stop()
