"""The gateway in front of stand-in SGLang servers, agentless (`[sglang] workers`), in one event loop:
real sockets, SGLang's own contract on every body. A busy server is killed, hung, turned unready or
made to send an error chunk mid-stream; every client stream completes with exactly the ids a run
without the fault gives, greedy and seeded, over both SGLang streaming forms."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from gateway.config import load_config
from gateway.core.health import WorkerState
from gateway.protocol.sglang import sglang_seed
from gateway.server.app import Gateway
from tests.fixtures.sglang_standin import SGLangStandIn, expected_ids, start_standin

PROMPTS = [list(b"Resume me exactly, request %d." % i) for i in range(6)]
MAX_TOKENS = 48
SEED = 424242


@contextlib.asynccontextmanager
async def sglang_cluster(
    n: int = 3, **overrides: Any
) -> AsyncIterator[tuple[Gateway, list[SGLangStandIn], aiohttp.ClientSession]]:
    servers = [
        await start_standin(
            incremental_streaming_output=(i % 2 == 1), token_delay_ms=15, max_running_requests=8
        )
        for i in range(n)
    ]
    cfg = load_config(
        overrides={
            "gateway.port": 0,
            "gateway.control_port": 0,
            "timeouts.control_stop_grace_s": 0.05,  # stop() cancels the workers' streams at once
            "recovery.mode": "lumen",
            "health.heartbeat_misses": 3,
            "sglang.poll_interval_ms": 50,
            "sglang.workers": [{"url": s.url, "id": f"sg{i}"} for i, s in enumerate(servers)],
            "recovery.stall_timeout_s": 5.0,
            **overrides,
        }
    )
    gw = Gateway(cfg)
    await gw.start()
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{gw.http_port}") as http:
            await wait_until(lambda: gw.monitor.healthy_count() == n, 10.0)
            yield gw, servers, http
    finally:
        await gw.stop()
        for s in servers:
            await s.stop()


async def wait_until(cond: Any, limit_s: float) -> None:
    async with asyncio.timeout(limit_s):
        while not cond():
            await asyncio.sleep(0.01)


async def stream_ids(
    http: aiohttp.ClientSession, prompt: list[int], seeded: bool, max_tokens: int = MAX_TOKENS
) -> list[int]:
    """One streaming completion; the ids decoded back from the byte text the client received."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "stream": True}
    body.update({"temperature": 0.8, "seed": SEED} if seeded else {"temperature": 0.0})
    text = ""
    async with http.post("/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.strip()
            if line.startswith(b"data:") and line != b"data: [DONE]":
                chunk = json.loads(line[5:])
                assert "error" not in chunk, chunk
                text += chunk["choices"][0]["text"]
    return list(text.encode())


def expected(prompt: list[int], seeded: bool) -> list[int]:
    if seeded:
        return expected_ids(prompt, MAX_TOKENS, 0.8, sglang_seed(SEED))
    return expected_ids(prompt, MAX_TOKENS, 0.0)


def busiest(servers: list[SGLangStandIn]) -> SGLangStandIn:
    return max(servers, key=lambda s: len(s.engine.running))


async def inject(fault: str, server: SGLangStandIn) -> None:
    if fault == "kill":
        await server.kill()
    elif fault == "hang":
        server.hang()
    elif fault == "not_ready":
        server.set_not_ready(True)
    else:
        server.error_chunk(scope="all")


@pytest.mark.parametrize("fault", ["kill", "hang", "not_ready", "error_chunk"])
async def test_a_fault_mid_stream_loses_no_token(fault: str) -> None:
    async with sglang_cluster() as (gw, servers, http):
        cases = [(p, i % 2 == 1) for i, p in enumerate(PROMPTS)]
        tasks = [asyncio.create_task(stream_ids(http, p, seeded)) for p, seeded in cases]
        # mid-stream: every request is running and has produced some tokens
        await wait_until(
            lambda: (
                sum(len(s.engine.running) for s in servers) == len(cases)
                and all(len(live.output_ids) >= 8 for s in servers for live in s.engine.running)
            ),
            10.0,
        )
        victim = busiest(servers)
        await inject(fault, victim)
        got = await asyncio.wait_for(asyncio.gather(*tasks), 30.0)
        for (prompt, seeded), ids in zip(cases, got, strict=True):
            assert ids == expected(prompt, seeded)
        assert all(s.stats()["refused"] == [] for s in servers)  # SGLang's contract took every body
        sessions = (
            [it for s in gw.sessions.recent_interrupted for it in s.interruptions] if gw.sessions else []
        )
        assert sessions, "the fault interrupted no request"
        victim_id = next(w for w in gw.monitor.workers.values() if w.http_url == victim.url).id
        assert {it.worker_id for it in sessions} == {victim_id}
        if fault in ("kill", "hang", "not_ready"):
            assert gw.monitor.workers[victim_id].state is WorkerState.FAILED


async def test_a_client_that_leaves_is_aborted_on_the_server() -> None:
    async with sglang_cluster(n=1) as (_gw, servers, http):
        body = {"prompt": PROMPTS[0], "max_tokens": 400, "stream": True, "temperature": 0.0}
        async with http.post("/v1/completions", json=body) as resp:
            await resp.content.readline()
        await servers[0].wait_for(lambda e: not e.running and not e.waiting, 5.0)
        assert servers[0].stats()["aborted_rids"], "the server still ran the request"


async def test_an_unready_server_is_not_attached_until_ready() -> None:
    server = await start_standin()
    server.set_not_ready(True)
    cfg = load_config(
        overrides={
            "gateway.port": 0,
            "gateway.control_port": 0,
            "timeouts.control_stop_grace_s": 0.05,
            "sglang.workers": [{"url": server.url}],
        }
    )
    gw = Gateway(cfg)
    await gw.start()
    try:
        await wait_until(lambda: server.not_ready_answers >= 3, 5.0)  # three polls answered 503
        assert gw.monitor.healthy_count() == 0 and "sglang-0" not in gw.monitor.workers
        server.set_not_ready(False)
        await wait_until(lambda: gw.monitor.healthy_count() == 1, 5.0)
        assert gw.monitor.workers["sglang-0"].engine == "sglang"
    finally:
        await gw.stop()
        await server.stop()
