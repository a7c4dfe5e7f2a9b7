"""The outage levers on real SGLang servers (sglang 0.5.23 on CPU): the queue order by request priority
and the batch held at the gateway (docs/sglang.md, "The outage levers on SGLang servers").

Two real servers launched as Lumen's agent launches them (the priority flags, `--max-running-requests`
with room for the boost: 3), held to 2 by the gateway (`[[sglang.workers]] held_batch`). The gateway
reads each server's `/server_info` and sends priorities; the servers take every body (no 400). Six
greedy streams: no server runs more than 2 before the kill; after one is killed, the survivor runs 3 at
once in `lumen` (the boost) and never more than 2 in `fixed_checkpoint`; every stream exact."""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from gateway.core.health import WorkerState
from gateway.server.app import Gateway
from tests.sglang.real import ServerPool, SGLangServer, stream_generate
from tests.sglang.test_real_agentless import direct, gateway_config, greedy
from worker_hooks.sglang.launcher import PRIORITY_FLAGS

pytestmark = pytest.mark.timeout(600)

HELD, ROOM = 2, 3
PROMPTS = [f"Held request {i}: the sea, the keeper, the light." for i in range(6)]
MAX_NEW = 240
LAUNCH = (*PRIORITY_FLAGS, "--max-running-requests", str(ROOM))


def running(server: SGLangServer) -> int:
    with urllib.request.urlopen(f"{server.url}/v1/loads", timeout=10) as resp:
        loads = json.loads(resp.read())
    return sum(int(r.get("num_running_reqs", 0)) for r in loads["loads"])


@contextlib.asynccontextmanager
async def held_gateway(
    servers: list[SGLangServer], mode: str
) -> AsyncIterator[tuple[Gateway, aiohttp.ClientSession]]:
    workers = [{"url": s.url, "id": f"sg{i}", "held_batch": HELD} for i, s in enumerate(servers)]
    cfg = gateway_config(servers, **{"recovery.mode": mode, "sglang.workers": workers})
    gw = Gateway(cfg)
    await gw.start()
    try:
        async with aiohttp.ClientSession(
            f"http://127.0.0.1:{gw.http_port}", timeout=aiohttp.ClientTimeout(total=180)
        ) as http:
            async with asyncio.timeout(30):
                while gw.monitor.healthy_count() < len(servers) or not all(
                    r.priority_order for r in gw.monitor.workers.values()
                ):
                    await asyncio.sleep(0.02)
            yield gw, http
    finally:
        await gw.stop()


class Peaks:
    """The most requests each server ran at once, sampled from its own `/v1/loads` while a test runs."""

    def __init__(self, servers: list[SGLangServer]) -> None:
        self.servers = servers
        self.peak = [0] * len(servers)
        self.before_kill = [0] * len(servers)
        self.killed = False

    async def watch(self) -> None:
        while True:
            for i, s in enumerate(self.servers):
                if s.alive():
                    with contextlib.suppress(OSError):
                        n = await asyncio.to_thread(running, s)
                        self.peak[i] = max(self.peak[i], n)
                        if not self.killed:
                            self.before_kill[i] = self.peak[i]
            await asyncio.sleep(0.05)


@pytest.mark.parametrize(("mode", "peak"), [("lumen", ROOM), ("fixed_checkpoint", HELD)])
async def test_held_real_servers_take_the_boost_only_in_lumens_modes(
    real_servers: ServerPool, mode: str, peak: int
) -> None:
    servers = real_servers.live(2, *LAUNCH)
    refs: list[Any] = await asyncio.gather(*(direct(servers[0], greedy(p, MAX_NEW)) for p in PROMPTS))
    async with held_gateway(servers, mode) as (gw, http):
        held = gw.levers.held
        peaks = Peaks(servers)
        watcher = asyncio.create_task(peaks.watch())
        seen: list[list[int]] = [[] for _ in PROMPTS]
        tasks = [
            asyncio.create_task(stream_generate(http, greedy(p, MAX_NEW), s))
            for p, s in zip(PROMPTS, seen, strict=True)
        ]
        async with asyncio.timeout(180):  # both servers at their held batch, two requests at the gateway
            while held.waiting("sg0") + held.waiting("sg1") < 2 or sum(len(s) >= 8 for s in seen) < 4:
                await asyncio.sleep(0.01)
        victim = 0 if held.waiting("sg0") > 0 else 1
        peaks.killed = True
        servers[victim].kill()
        got = await asyncio.wait_for(asyncio.gather(*tasks), 180)
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
        for ref, ids in zip(refs, got, strict=True):
            assert ids == ref["output_ids"]
        assert max(peaks.before_kill) <= HELD
        assert peaks.peak[1 - victim] == peak
        assert gw.monitor.workers[f"sg{victim}"].state is WorkerState.FAILED
