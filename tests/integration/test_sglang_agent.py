"""The SGLang sidecar agent against a real gateway started in process, with SGLang stand-ins.

Stand-ins (tests/fixtures/sglang_standin.py) run in process where the test needs their internals
(faults, stats), or as processes the agent launches itself (`launch=`, through the launch shim that
checks the flags Lumen adds). One event loop holds the gateway, the agents and the clients, so every
time below is on one clock (`time.monotonic()`, the gateway monitor's clock).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest

from gateway.config import load_config
from gateway.core.detectorparams import DetectorParams
from gateway.core.health import WorkerState
from gateway.protocol import control_pb2 as pb
from gateway.protocol.generate import EngineKind
from gateway.protocol.sglang import sglang_seed
from gateway.server.app import Gateway
from gateway.server.workers.monitor import StateEvent, WorkerRecord
from tests.fixtures.sglang_standin import SGLangStandIn, expected_ids, start_standin
from worker_hooks.sglang.agent import Sidecar
from worker_hooks.sglang.agent_config import SidecarConfig
from worker_hooks.sglang.launcher import server_command

SHIM = [sys.executable, "-m", "tests.e2e.sglang_launch_shim"]
POLL_S = 0.02
# one cluster secret for every gateway of a test (an agent attaches to all of them with it)
TOKEN = "test-control-token-0123456789"
FAST = {"poll_interval_s": POLL_S, "poll_misses": 5, "token": TOKEN}


@contextlib.asynccontextmanager
async def gateway(**overrides: Any) -> AsyncIterator[Gateway]:
    cfg = load_config(
        overrides={
            "gateway.port": 0,
            "gateway.control_port": 0,
            "timeouts.control_stop_grace_s": 0.05,  # stop() cancels the workers' streams at once
            "gateway.control_token": TOKEN,
            "recovery.mode": "stop_restart",
            "health.heartbeat_interval_ms": 50,
            "health.heartbeat_misses": 6,
            **overrides,
        }
    )
    gw = Gateway(cfg)
    await gw.start()
    try:
        yield gw
    finally:
        await gw.stop()


@contextlib.asynccontextmanager
async def sidecar(
    gateways: list[Gateway], url: str, worker_id: str = "s0", **kw: Any
) -> AsyncIterator[Sidecar]:
    launch = kw.pop("launch", None)
    cfg = SidecarConfig(
        worker_id=worker_id,
        url=url,
        gateways=tuple(f"127.0.0.1:{gw.control_port}" for gw in gateways),
        **{**FAST, **kw},
    )
    sc = Sidecar(cfg, launch=launch)
    await sc.start()
    try:
        yield sc
    finally:
        await sc.stop(grace_s=5.0)


@contextlib.asynccontextmanager
async def standin(**kw: Any) -> AsyncIterator[SGLangStandIn]:
    s = await start_standin(**kw)
    try:
        yield s
    finally:
        await s.stop()


def free_url() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


async def state_event(gw: Gateway, pred: Callable[[StateEvent], bool], within: float = 15.0) -> StateEvent:
    """The first state change (past or future) matching `pred`."""
    for ev in gw.monitor.events:
        if pred(ev):
            return ev
    fut: asyncio.Future[StateEvent] = asyncio.get_running_loop().create_future()

    def cb(ev: StateEvent) -> None:
        if pred(ev) and not fut.done():
            fut.set_result(ev)

    gw.monitor.on_state_change.append(cb)
    try:
        return await asyncio.wait_for(fut, within)
    finally:
        gw.monitor.on_state_change.remove(cb)


def to(wid: str, state: WorkerState, newer_than: int = 0) -> Callable[[StateEvent], bool]:
    return lambda e: e.worker_id == wid and e.dst is state and e.incarnation > newer_than


async def heartbeat(
    gw: Gateway, pred: Callable[[WorkerRecord, pb.Heartbeat], bool], within: float = 10.0
) -> pb.Heartbeat:
    """The next heartbeat the gateway takes that matches `pred`."""
    fut: asyncio.Future[pb.Heartbeat] = asyncio.get_running_loop().create_future()

    def hook(rec: WorkerRecord, hb: pb.Heartbeat) -> None:
        if pred(rec, hb) and not fut.done():
            fut.set_result(hb)

    gw.control.heartbeat_hooks.append(hook)
    try:
        return await asyncio.wait_for(fut, within)
    finally:
        gw.control.heartbeat_hooks.remove(hook)


async def generate(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """Stream one /generate; the last chunk (cumulative output_ids)."""
    last: dict[str, Any] = {}
    async with http.post(url + "/generate", json={**body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.strip()
            if line.startswith(b"data:") and line != b"data: [DONE]":
                last = json.loads(line[5:])
    return last


def request(i: int, n: int) -> tuple[dict[str, Any], list[int]]:
    """Request i (even: greedy, odd: seeded) and the ids a failure-free server returns for it."""
    prompt = [32 + (i * 7 + j) % 90 for j in range(20 + i)]
    temperature, seed = (0.0, None) if i % 2 == 0 else (0.9, 1000 + i)
    sp: dict[str, Any] = {"max_new_tokens": n, "temperature": temperature}
    if seed is not None:
        sp["sampling_seed"] = seed
    want = expected_ids(prompt, n, temperature, None if seed is None else sglang_seed(seed))
    return {"input_ids": prompt, "sampling_params": sp}, want


# -- attach, phases, load -------------------------------------------------------------------------------


async def test_attaches_as_an_sglang_worker_loading_then_serving_with_the_servers_load() -> None:
    async with gateway() as gw, standin(token_delay_ms=20) as server:
        server.set_not_ready(True)  # still loading
        async with sidecar([gw], server.url) as sc:
            joined = await state_event(gw, to("s0", WorkerState.JOINING))
            rec = gw.monitor.workers["s0"]
            assert rec.engine is EngineKind.SGLANG and rec.http_url == server.url
            assert rec.incarnation == joined.incarnation == sc.clients[0].role.incarnation
            await heartbeat(gw, lambda r, hb: hb.phase == pb.LOADING_FULL)
            assert rec.state is WorkerState.JOINING  # not routed to while loading
            server.set_not_ready(False)
            await state_event(gw, to("s0", WorkerState.HEALTHY))

            # heartbeats carry the server's own load (/v1/loads), summed over its DP ranks
            async with aiohttp.ClientSession() as http:
                body = {"input_ids": [40, 41, 42], "sampling_params": {"max_new_tokens": 400}}
                direct = [asyncio.create_task(generate(http, server.url, body)) for _ in range(3)]
                hb = await heartbeat(gw, lambda r, hb: hb.running == 3)
                assert hb.phase == pb.SERVING and hb.kv_tokens_used > 0
                assert rec.running == 3
                server.engine.abort(abort_all=True)
                await asyncio.gather(*direct)

            # Drain from the gateway: the agent reports DRAINING (the gateway stops routing to it)
            gw.control.send("s0", pb.GatewayMessage(drain=pb.Drain()))
            await state_event(gw, to("s0", WorkerState.DRAINING))


# -- the server dies ------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def launched(gw: Gateway, *ids: str, **kw: Any) -> AsyncIterator[list[Sidecar]]:
    """Agents that launch their stand-ins (through the shim that checks Lumen's flags), HEALTHY."""
    async with contextlib.AsyncExitStack() as stack:
        out = []
        for wid in ids:
            url = free_url()
            extra = ["--model-path", "standin", "--token-delay-ms", "25"]
            launch = server_command(url, extra, env={"LUMEN_SGLANG_LAUNCHER": " ".join(SHIM)})
            out.append(await stack.enter_async_context(sidecar([gw], url, wid, launch=launch, **kw)))
        for wid in ids:
            await state_event(gw, to(wid, WorkerState.HEALTHY))
        yield out


async def test_a_launched_server_that_dies_fails_its_incarnation_within_100_ms() -> None:
    """Kill-detection latency through the agent's child-exit watcher (no stream is open to the server,
    and the agent polls only every 0.5 s here, so nothing else tells the gateway first). One clock: the
    test sends the stand-in its kill fault at `sent`; the stand-in answers, then exits; the watcher
    sees the exit (`seen_at`), the agent ends its control stream, and the gateway records FAILED at
    `failed.t`. The server died after `sent`, so `failed.t - sent` bounds the latency from above;
    `failed.t - seen_at` is the part after the agent saw the exit."""
    async with (
        gateway() as gw,
        launched(gw, "s0", poll_interval_s=0.5) as [s0],
        aiohttp.ClientSession() as http,
    ):
        first = gw.monitor.workers["s0"]
        assert first.pid == s0.server_pid and s0.server_pid is not None  # Hello names the server's pid
        sent = time.monotonic()
        async with http.post(s0.cfg.url + "/standin/fault", json={"kind": "kill"}) as resp:
            assert resp.status == 200
        failed = await state_event(gw, to("s0", WorkerState.FAILED))
        exited = await s0.wait_event(lambda e: e["event"] == "server_exited", 5)
        lost = await s0.wait_event(lambda e: e["event"] == "server_lost", 5)
        assert lost["reason"].startswith(f"server process {exited['pid']} exited")  # the watcher's news
        # the old stream's end and the restarted server's Hello travel on different streams: either may
        # reach the gateway first, and both fail the old incarnation
        assert failed.incarnation == first.incarnation
        assert failed.reason in ("control stream ended", "replaced by a new incarnation")
        assert sent <= exited["seen_at"] <= failed.t
        print(
            f"kill -> FAILED <= {1000 * (failed.t - sent):.1f} ms "
            f"(exit seen -> FAILED {1000 * (failed.t - exited['seen_at']):.1f} ms)"
        )
        assert failed.t - sent < 0.1, f"FAILED {1000 * (failed.t - sent):.1f} ms after the kill"
        # the agent restarts the server and attaches it as a new incarnation once /ready is 200
        back = await state_event(gw, to("s0", WorkerState.HEALTHY, newer_than=first.incarnation))
        assert (
            back.t > failed.t and s0.server is not None and s0.server.starts >= 2
        )  # relaunched (a busy machine may need a second try)


async def test_a_busy_server_killed_mid_stream_leaves_every_stream_exact() -> None:
    n = 60
    # the survivor takes every stream at once: its /ready may be slow to answer on a busy machine, and
    # the 100 ms poll window of FAST once declared it lost mid-test (the kill itself is seen by broken
    # streams and the child-exit watcher, not by polls)
    async with (
        gateway() as gw,
        launched(gw, "s0", "s1", poll_interval_s=0.1) as [s0, _],
        aiohttp.ClientSession() as http,
    ):
        first = gw.monitor.workers["s0"].incarnation
        cases = [request(i, n) for i in range(12)]
        gw_url = f"http://127.0.0.1:{gw.http_port}"
        streams = [asyncio.create_task(generate(http, gw_url, body)) for body, _ in cases]

        def streaming_on_s0(_r: WorkerRecord, _hb: pb.Heartbeat) -> bool:  # checked at each heartbeat
            live = gw.sessions.live.values() if gw.sessions is not None else []
            return sum(1 for s in live if s.worker_id == "s0" and len(s.emitted) >= 5) >= 3

        await heartbeat(gw, streaming_on_s0)
        sent = time.monotonic()
        async with http.post(s0.cfg.url + "/standin/fault", json={"kind": "kill"}) as resp:
            assert resp.status == 200
        failed = await state_event(gw, to("s0", WorkerState.FAILED))
        assert failed.incarnation == first and failed.t - sent < 0.1  # broken streams or the agent
        results = await asyncio.gather(*streams)
        for (_, want), got in zip(cases, results, strict=True):
            assert got["output_ids"] == want
            assert got["meta_info"]["finish_reason"]["type"] == "length"
        assert gw.sessions is not None
        cut = [
            i
            for s in gw.sessions.recent_interrupted
            for i in s.interruptions
            # a stream that broke after its last token has nothing to resume: it finishes as it is
            if i.worker_id == "s0" and 0 < i.emitted_before < s.job.sampling.max_new_tokens
        ]
        assert len(cut) >= 3 and all(i.resumed_on == "s1" for i in cut)


async def test_an_unlaunched_server_that_dies_is_seen_by_a_refused_poll() -> None:
    async with gateway() as gw:
        server = await start_standin()
        port = int(server.url.rsplit(":", 1)[1])
        async with sidecar([gw], server.url) as sc:
            first = await state_event(gw, to("s0", WorkerState.HEALTHY))
            killed = time.monotonic()
            await server.kill()
            failed = await state_event(gw, to("s0", WorkerState.FAILED))
            assert failed.t - killed < POLL_S + 0.1
            lost = await sc.wait_event(lambda e: e["event"] == "server_lost", 1)
            assert lost["reason"] == "connection refused"
            await server.stop()
            # whoever runs the server starts it again: the agent re-attaches it as a new incarnation
            async with standin(port=port):
                await state_event(gw, to("s0", WorkerState.HEALTHY, newer_than=first.incarnation))


async def test_a_hung_server_is_lost_within_the_cap_and_returns_as_a_new_incarnation() -> None:
    async with gateway() as gw, standin() as server, sidecar([gw], server.url) as sc:
        first = await state_event(gw, to("s0", WorkerState.HEALTHY))
        hung = time.monotonic()
        server.hang()  # /ready stops answering; the agent's heartbeats would go on without the poll
        failed = await state_event(gw, to("s0", WorkerState.FAILED))
        # never before poll_misses poll periods, never after the cap (a server just attached is given
        # the cap: gateway/core/polls.py prime)
        floor = sc.cfg.poll_interval_s * sc.cfg.poll_misses
        assert floor <= failed.t - hung < DetectorParams().max_silence_s + 0.5
        lost = await sc.wait_event(lambda e: e["event"] == "server_lost", 1)
        assert lost["reason"].startswith("/ready silent: no heartbeat for")
        server.normal()
        await state_event(gw, to("s0", WorkerState.HEALTHY, newer_than=first.incarnation))
        assert server.stats()["abort_calls"] == 0  # a server that was not serving is not asked to abort


# -- fencing and several gateways -----------------------------------------------------------------------


async def test_a_fenced_session_aborts_everything_on_the_server_and_reattaches() -> None:
    async with gateway() as gw, standin(token_delay_ms=20) as server, sidecar([gw], server.url) as sc:
        first = await state_event(gw, to("s0", WorkerState.HEALTHY))
        async with aiohttp.ClientSession() as http:
            body = {"input_ids": [50, 51], "sampling_params": {"max_new_tokens": 2000}}
            zombie = asyncio.create_task(generate(http, server.url, body))
            await heartbeat(gw, lambda r, hb: hb.running == 1)
            # the gateway declares the incarnation failed (as for a broken data stream) and fences it
            gw.monitor.report_data_failure("s0", first.incarnation, "test")
            again = await state_event(gw, to("s0", WorkerState.HEALTHY, newer_than=first.incarnation))
            done = await asyncio.wait_for(zombie, 5)
        assert done["meta_info"]["finish_reason"]["type"] == "abort"
        stats = server.stats()
        assert stats["abort_calls"] == 1 and stats["running"] == 0
        abort = await sc.wait_event(lambda e: e["event"] == "abort_all", 1)
        assert abort["ok"] and abort["at"] < again.t  # aborted before the new incarnation attached


async def test_two_gateways_get_one_session_each_and_the_same_truth() -> None:
    async with (
        gateway() as a,
        gateway() as b,
        standin(token_delay_ms=20) as server,
        sidecar([a, b], server.url) as sc,
    ):
        first_a = await state_event(a, to("s0", WorkerState.HEALTHY))
        first_b = await state_event(b, to("s0", WorkerState.HEALTHY))
        async with aiohttp.ClientSession() as http:
            body = {"input_ids": [60, 61], "sampling_params": {"max_new_tokens": 2000}}
            direct = [asyncio.create_task(generate(http, server.url, body)) for _ in range(2)]
            await asyncio.gather(
                heartbeat(a, lambda r, hb: hb.running == 2), heartbeat(b, lambda r, hb: hb.running == 2)
            )
            # gateway a fences the agent: its session comes back as a new incarnation; b's is untouched,
            # and the server is not told to abort (b's requests run there too)
            a.monitor.report_data_failure("s0", first_a.incarnation, "test")
            await state_event(a, to("s0", WorkerState.HEALTHY, newer_than=first_a.incarnation))
            assert b.monitor.workers["s0"].incarnation == first_b.incarnation
            assert b.monitor.workers["s0"].state is WorkerState.HEALTHY
            assert server.stats()["abort_calls"] == 0 and server.stats()["running"] == 2
            server.engine.abort(abort_all=True)
            await asyncio.gather(*direct)
        assert [c.sessions for c in sc.clients] == [2, 1]


@pytest.mark.parametrize("gateways", [[], ["h:1", "h:1"]])
def test_the_config_refuses_no_gateway_or_one_named_twice(gateways: list[str]) -> None:
    with pytest.raises(ValueError, match="gateway"):
        SidecarConfig(worker_id="s", url="http://127.0.0.1:1", gateways=tuple(gateways))
