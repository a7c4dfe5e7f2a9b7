"""The queue order Lumen keeps, on SGLang servers launched with priority scheduling (in one event loop,
real sockets, SGLang's contract on every body): the gateway reads each server's /server_info and,
where the server orders its queue by priority (lower first, no preemption), sends every request the
priority of its queue rank (gateway/core/outage.py `queue_priority`): FIFO outside a recovery, aged
shortest-prefill-first while one lasts in Lumen's modes, FIFO in the baselines. Each stand-in runs one
request at a time, so the order its queue is served in is the order the test reads back."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from gateway.config import load_config
from gateway.core.health import WorkerState
from gateway.server.app import Gateway
from tests.fixtures.sglang_standin import SGLangStandIn, start_standin

LONG = [65] * 3000  # 3,000 tokens to prefill: aged by 1.5 s at the default 2,000 tokens per second
SHORT = [66] * 5


@contextlib.asynccontextmanager
async def cluster(
    n: int, mode: str, priority: bool = True
) -> AsyncIterator[tuple[Gateway, list[SGLangStandIn], aiohttp.ClientSession]]:
    servers = [
        await start_standin(token_delay_ms=20, max_running_requests=1, priority_scheduling=priority)
        for _ in range(n)
    ]
    cfg = load_config(
        overrides={
            "gateway.port": 0,
            "gateway.control_port": 0,
            "timeouts.control_stop_grace_s": 0.05,  # stop() cancels the workers' streams at once
            "recovery.mode": mode,
            "health.heartbeat_misses": 20,  # a kill is seen by refused polls; silence needs 1 s here
            "sglang.poll_interval_ms": 50,
            "sglang.workers": [{"url": s.url, "id": f"sg{i}"} for i, s in enumerate(servers)],
        }
    )
    gw = Gateway(cfg)
    await gw.start()
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{gw.http_port}") as http:
            reader = gw.server_info
            assert reader is not None
            # every server attached and its /server_info read
            await until(
                lambda: gw.monitor.healthy_count() == n and len(reader._asked) == n and not reader._tasks
            )
            yield gw, servers, http
    finally:
        await gw.stop()
        for s in servers:
            await s.stop()


async def until(cond: Any, limit_s: float = 10.0) -> None:
    async with asyncio.timeout(limit_s):
        while not cond():
            await asyncio.sleep(0.01)


async def complete(http: aiohttp.ClientSession, prompt: list[int], max_tokens: int) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    async with http.post("/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()


def served_order(server: SGLangStandIn) -> list[int]:
    """The positions (in the order they reached the server) of the requests in the order it ran them."""
    stats = server.stats()
    arrived = [r for r in stats["rids"]]
    return [arrived.index(r) for r in stats["admitted"] if r in arrived]


async def queue_behind_the_running_one(
    http: aiohttp.ClientSession, server: SGLangStandIn
) -> list[asyncio.Task[None]]:
    """A 3,000-token prompt, then a 5-token one, each once the one before waits in `server`'s queue."""
    tasks = []
    for i, prompt in enumerate((LONG, SHORT)):
        tasks.append(asyncio.create_task(complete(http, prompt, 1)))
        await server.wait_for(lambda e, k=i + 1: len(e.waiting) == k)
    return tasks


async def test_a_priority_server_is_sent_priorities_and_serves_fifo_outside_a_recovery() -> None:
    async with cluster(1, "lumen") as (gw, [server], http):
        assert gw.monitor.workers["sg0"].priority_order
        first = asyncio.create_task(complete(http, SHORT, 120))  # 2.4 s: the others queue behind it
        await server.wait_for(lambda e: len(e.running) == 1)
        tasks = await queue_behind_the_running_one(http, server)
        await asyncio.wait_for(asyncio.gather(first, *tasks), 20.0)
        assert served_order(server) == [0, 1, 2]
        assert server.stats()["refused"] == []  # SGLang's contract took every body, priority included


async def test_a_server_without_priority_scheduling_is_sent_none() -> None:
    async with cluster(1, "lumen", priority=False) as (gw, [server], http):
        assert not gw.monitor.workers["sg0"].priority_order
        await complete(http, SHORT, 2)
        assert server.stats()["refused"] == []


@pytest.mark.parametrize(("mode", "order"), [("lumen", [0, 2, 1]), ("fixed_checkpoint", [0, 1, 2])])
async def test_while_a_recovery_lasts_lumen_serves_short_prompts_first_and_the_baselines_fifo(
    mode: str, order: list[int]
) -> None:
    async with cluster(2, mode) as (gw, servers, http):
        resumed = asyncio.create_task(complete(http, SHORT, 150))  # 3 s of decoding
        await until(
            lambda: any(s.engine.running and len(s.engine.running[0].output_ids) >= 5 for s in servers)
        )
        victim = next(s for s in servers if s.engine.running)
        survivor = next(s for s in servers if s is not victim)
        await victim.kill()
        # the interrupted request resumes on the survivor, which runs it (one at a time)
        await survivor.wait_for(lambda e: len(e.running) == 1)
        await until(lambda: any(w.state is WorkerState.FAILED for w in gw.monitor.workers.values()))
        assert (gw.outage is not None and gw.outage.recovering) == (mode == "lumen")
        tasks = await queue_behind_the_running_one(http, survivor)
        await asyncio.wait_for(asyncio.gather(resumed, *tasks), 20.0)
        # the resumed request, then (Lumen) the 5-token prompt ahead of the 3,000-token one
        assert served_order(survivor) == order
