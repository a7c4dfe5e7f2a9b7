"""The outage batch boost on SGLang servers, held at the gateway (gateway/server/workers/held.py): the
agent reports `held_batch` for a server launched with room for the boost (here: stand-ins that admit 3,
held to 2), the gateway never lets more than 2 run on it outside a recovery, and while a recovery lasts
in Lumen's modes it lets 3 run on the survivor (boost min(1.5, 2/1) = 1.5, floor(2 x 1.5) = 3); the
baselines stay at 2. Every client stream is exact. One event loop: gateway, agents, in-process stand-ins."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest

from gateway.config import ConfigError, load_config
from gateway.core.health import WorkerState
from gateway.server.app import Gateway
from tests.fixtures.sglang_standin import SGLangStandIn, expected_ids, start_standin
from tests.integration.test_sglang_gateway import stream_ids as greedy_stream_ids
from worker_hooks.sglang.agent import Sidecar
from worker_hooks.sglang.agent_config import SidecarConfig
from worker_hooks.sglang.agent_role import SGLangRole

TOKEN = "test-control-token-0123456789"
HELD, ROOM = 2, 3
PROMPTS = [list(b"Held at the gateway, request %d." % i) for i in range(6)]
MAX_TOKENS = 60  # 1.2 s of decoding at 20 ms per token


@contextlib.asynccontextmanager
async def cluster(
    mode: str, n: int = 2, held: int = HELD, room: int = ROOM
) -> AsyncIterator[tuple[Gateway, list[SGLangStandIn], aiohttp.ClientSession]]:
    cfg = load_config(
        overrides={
            "gateway.port": 0,
            "gateway.control_port": 0,
            "timeouts.control_stop_grace_s": 0.05,  # stop() cancels the workers' streams at once
            "gateway.control_token": TOKEN,
            "recovery.mode": mode,
            "health.heartbeat_interval_ms": 50,
            # a busy 2-core box can starve heartbeats for a few hundred ms: a false failure would hand
            # the survivor a new incarnation (and gate) while its old requests still run. The kill is
            # seen by the broken streams and the agent's refused polls, not by silence.
            "health.heartbeat_misses": 40,
        }
    )
    gw = Gateway(cfg)
    await gw.start()
    async with contextlib.AsyncExitStack() as stack:
        stack.push_async_callback(gw.stop)
        servers = []
        for i in range(n):
            s = await start_standin(token_delay_ms=20, max_running_requests=room)
            stack.push_async_callback(s.stop)
            servers.append(s)
            sc = Sidecar(
                SidecarConfig(
                    worker_id=f"s{i}",
                    url=s.url,
                    gateways=(f"127.0.0.1:{gw.control_port}",),
                    poll_interval_s=0.02,
                    poll_misses=50,  # a busy box can starve the agent's /ready polls for 200 ms
                    token=TOKEN,
                    held_batch=held,
                )
            )
            await sc.start()
            stack.push_async_callback(sc.stop, 5.0)
        async with asyncio.timeout(15):
            while gw.monitor.healthy_count() < n:
                await asyncio.sleep(0.01)
        http = await stack.enter_async_context(aiohttp.ClientSession(f"http://127.0.0.1:{gw.http_port}"))
        yield gw, servers, http


async def stream_ids(http: aiohttp.ClientSession, prompt: list[int]) -> list[int]:
    return await greedy_stream_ids(http, prompt, seeded=False, max_tokens=MAX_TOKENS)


@pytest.mark.parametrize(("mode", "peak"), [("lumen", ROOM), ("fixed_checkpoint", HELD)])
async def test_the_survivor_takes_the_boost_only_in_lumens_modes_and_every_stream_is_exact(
    mode: str, peak: int
) -> None:
    async with cluster(mode) as (gw, servers, http):
        held = gw.levers.held
        recs = [gw.monitor.workers[f"s{i}"] for i in range(2)]
        assert [r.held_batch for r in recs] == [HELD, HELD]
        tasks = [asyncio.create_task(stream_ids(http, p)) for p in PROMPTS]
        # six streams, two servers held to two each: two wait at the gateway, none in a server's queue
        async with asyncio.timeout(10):
            while held.waiting("s0") + held.waiting("s1") < 2 or any(
                len(s.engine.running) < HELD for s in servers
            ):
                await asyncio.sleep(0.01)
        assert all(len(s.engine.running) == HELD and not s.engine.waiting for s in servers)
        assert [r.batch_limit for r in recs] == [ROOM, ROOM]  # what each server admits, from heartbeats
        async with http.get(
            "/admin/workers", headers={"Authorization": f"Bearer {gw.config.gateway.admin_api_keys[0]}"}
        ) as resp:  # what an SRE sees of the hold
            shown = {w["id"]: w for w in await resp.json()}
        assert [shown[f"s{i}"]["batch_limit"] for i in range(2)] == [HELD, HELD]
        assert sum(shown[f"s{i}"]["held_waiting"] for i in range(2)) == 2
        async with http.get("/metrics") as resp:
            text = await resp.text()
        assert 'lumen_sglang_held_limit{worker="s0"} 2.0' in text
        assert 'lumen_sglang_held_waiting{worker="s1"}' in text
        victim = next(s for s, r in zip(servers, recs, strict=True) if held.waiting(r.id) > 0)
        survivor = next(s for s in servers if s is not victim)
        kept = next(r for r in recs if r.http_url == survivor.url)
        await victim.kill()
        got = await asyncio.wait_for(asyncio.gather(*tasks), 60.0)
        for prompt, ids in zip(PROMPTS, got, strict=True):
            assert ids == expected_ids(prompt, MAX_TOKENS, 0.0)
        assert gw.monitor.workers[kept.id].incarnation == kept.incarnation  # no false failure meanwhile
        assert survivor.stats()["peak_running"] == peak
        victim_id = next(r.id for r in recs if r.http_url == victim.url)
        assert any(e.worker_id == victim_id and e.dst is WorkerState.FAILED for e in gw.monitor.events)
        assert survivor.stats()["refused"] == []


@pytest.mark.slow
async def test_under_load_with_clients_leaving_no_slot_leaks_and_no_server_runs_past_its_limit() -> None:
    """The gate under load: 48 streams of mixed lengths on three servers held to 4 (room 6), a quarter of
    the clients leaving mid-stream or while they wait, the busiest server killed. Every finished stream
    is exact; no survivor ever ran more than the boosted limit (floor(4 x 1.5) = 6) nor, before the
    kill, more than 4; and afterwards every gate is empty: no slot was leaked by a client that left,
    by a stream that moved, or by the dead server's waiters."""
    held, room = 4, 6
    prompts = [list(b"Load on held servers, request %d." % i) for i in range(48)]
    lengths = [20 + 7 * (i % 9) for i in range(48)]
    async with cluster("lumen", n=3, held=held, room=room) as (gw, servers, http):
        gates = gw.levers.held

        async def one(i: int) -> list[int]:
            return await greedy_stream_ids(http, prompts[i], seeded=False, max_tokens=lengths[i])

        tasks = [asyncio.create_task(one(i)) for i in range(48)]
        async with asyncio.timeout(10):  # every server at its held batch, the rest waiting at the gateway
            while sum(gates.waiting(f"s{i}") for i in range(3)) < 48 - 3 * held or any(
                len(s.engine.running) < held for s in servers
            ):
                await asyncio.sleep(0.01)
        assert max(s.stats()["peak_running"] for s in servers) == held
        leaving = tasks[::4]  # some running, some still waiting for a slot
        for t in leaving:
            t.cancel()
        victim = max(servers, key=lambda s: len(s.engine.running))
        survivors = [s for s in servers if s is not victim]
        await victim.kill()
        staying = [(i, t) for i, t in enumerate(tasks) if t not in leaving]
        got = await asyncio.wait_for(asyncio.gather(*(t for _i, t in staying)), 120.0)
        for (i, _t), ids in zip(staying, got, strict=True):
            assert ids == expected_ids(prompts[i], lengths[i], 0.0), i
        await asyncio.gather(*leaving, return_exceptions=True)
        assert all(s.stats()["peak_running"] <= room for s in survivors)
        assert all(s.stats()["refused"] == [] for s in survivors)
        kept = [r for r in gw.monitor.workers.values() if r.http_url != victim.url]

        def slots_taken() -> int:
            return sum(gate.running for gate in map(gates.gate, kept) if gate is not None)

        async with asyncio.timeout(20):  # the gateway sees every leaver's stream end
            while slots_taken():
                await asyncio.sleep(0.05)
        for s in survivors:
            assert not s.engine.running and not s.engine.waiting
        assert all(gates.waiting(w) == 0 for w in gw.monitor.workers)


@pytest.mark.parametrize(("gateways", "share"), [(1, 8), (2, 4), (3, 2), (16, 1)])
def test_several_gateways_each_hold_their_share_of_the_batch(gateways: int, share: int) -> None:
    """Each gateway holds a server on its own: the agent gives each its share, so that together they
    keep the server to its batch (and, boosted, to the room it was launched with)."""
    cfg = SidecarConfig(
        worker_id="s0",
        url="http://127.0.0.1:30000",
        gateways=tuple(f"127.0.0.1:{7000 + i}" for i in range(gateways)),
        token=TOKEN,
        held_batch=8,
    )
    assert SGLangRole(Sidecar(cfg)).hello().held_batch == share


async def test_an_agentless_server_is_held_by_its_config() -> None:
    """`[[sglang.workers]] held_batch = 2`: the gateway polls the server itself and holds it to 2."""
    server = await start_standin(token_delay_ms=20, max_running_requests=ROOM)
    cfg = load_config(
        overrides={
            "gateway.port": 0,
            "gateway.control_port": 0,
            "timeouts.control_stop_grace_s": 0.05,  # stop() cancels the workers' streams at once
            "recovery.mode": "lumen",
            "sglang.poll_interval_ms": 50,
            "sglang.workers": [{"url": server.url, "id": "sg0", "held_batch": HELD}],
        }
    )
    gw = Gateway(cfg)
    await gw.start()
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{gw.http_port}") as http:
            async with asyncio.timeout(10):
                while gw.monitor.healthy_count() < 1:
                    await asyncio.sleep(0.01)
            assert gw.monitor.workers["sg0"].held_batch == HELD
            got = await asyncio.wait_for(asyncio.gather(*(stream_ids(http, p) for p in PROMPTS[:4])), 30.0)
            assert got == [expected_ids(p, MAX_TOKENS, 0.0) for p in PROMPTS[:4]]
            assert server.stats()["peak_running"] == HELD  # the server admits 3; the gateway held it to 2
    finally:
        await gw.stop()
        await server.stop()


def test_a_held_batch_out_of_range_is_a_config_error_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"sglang.workers\[0\].held_batch"):
        load_config(overrides={"sglang.workers": [{"url": "http://127.0.0.1:30000", "held_batch": -1}]})
