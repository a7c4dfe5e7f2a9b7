"""Restore on the holder through the gateway (issue 14, item 3): two stand-in SGLang servers, each with
Lumen's page store as its storage tier (what `LumenHiCacheStorage` does inside SGLang) and a holder
store; the gateway assigns the serving server a holder and sends it as `kv_hints`; the stand-in plays
Lumen's plugin (it routes the request's pages to the holders its kv_hints name). The serving server is
killed mid-stream; recovery dispatch resumes the request on its holder, which restores the prompt's
pages from its own store (cached_tokens > 0, bit-exact or not counted) and continues exactly.

The servers attach at the control-plane seam (Hello with engine "sglang", the holder endpoint and budget,
heartbeats with their load), as their sidecar agents would; with `report_holders`, the heartbeats are the
agent's own (`SGLangRole.heartbeat`), carrying what it polls from the holder store's status socket, so the
holder's durable prefix reaches the gateway's checkpoint books and recovery dispatch."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from gateway.config import load_config
from gateway.protocol import control_pb2 as pb
from gateway.protocol.pagekeys import page_keys
from gateway.protocol.planes import Member, MemberTable, PlaneAuth
from gateway.protocol.sglang import parse_kv_hints, sglang_rid
from gateway.server.app import Gateway
from tests.fixtures.sglang_standin import SGLangStandIn, expected_ids, start_standin
from tests.integration.test_sglang_gateway import stream_ids, wait_until
from worker_hooks.kv.payload import page_bytes, verify
from worker_hooks.sglang.agent import Sidecar
from worker_hooks.sglang.agent_config import SidecarConfig
from worker_hooks.sglang.agent_role import SGLangRole
from worker_hooks.sglang.page_routes import RequestRoutes
from worker_hooks.sglang.page_store import PageStore
from worker_hooks.sglang.page_store_config import PageStoreConfig

PS = 64
PAGE_BYTES = 2048
BUDGET = 1 << 30


class PluginTier:
    """The stand-in engine's storage tier: what SGLang does with Lumen's backend plus what Lumen's
    plugin does (route a request's pages to the holders its kv_hints name)."""

    def __init__(self, server: SGLangStandIn, store: PageStore, routes: RequestRoutes) -> None:
        self.server, self.store, self.routes = server, store, routes
        self.restored: list[tuple[str, int]] = []

    def restore(self, rid: str, ids: list[int], limit: int) -> int:
        keys = page_keys(ids[:limit], PS)
        hit = self.store.batch_exists(keys)
        good = 0
        for key, page in zip(keys, self.store.batch_get(keys[:hit]), strict=False):
            if page is None or not verify(key, page):
                break
            good += 1
        self.restored.append((rid, good * PS))
        return good * PS

    def backup(self, rid: str, ids: list[int]) -> None:
        live = self.server.engine.live.get(rid)
        ck = parse_kv_hints(live.req.kv_hints) if live is not None else None
        if ck is None:
            return  # no kv_hints: no checkpoint
        self.routes.admit(rid, ids, tuple(h.kv_endpoint for h in ck.holders))
        keys = page_keys(ids, PS)
        self.store.batch_set(keys, [page_bytes(k, PAGE_BYTES) for k in keys])


@contextlib.asynccontextmanager
async def two_servers_with_holders(
    *, report_holders: bool = False, **overrides: Any
) -> AsyncIterator[tuple[Gateway, dict[str, SGLangStandIn], dict[str, PluginTier]]]:
    cfg = load_config(
        overrides={
            "gateway.port": 0,
            "gateway.control_port": 0,
            "timeouts.control_stop_grace_s": 0.05,  # stop() cancels the workers' streams at once
            "recovery.mode": "lumen",
            "health.heartbeat_interval_ms": 20,
            "health.heartbeat_misses": 5,
            "model.preset": "Qwen3-0.6B",
            **overrides,
        }
    )
    gw = Gateway(cfg)
    await gw.start()
    servers: dict[str, SGLangStandIn] = {}
    tiers: dict[str, PluginTier] = {}
    stores: list[PageStore] = []
    beats: list[asyncio.Task[None]] = []
    agents: list[Sidecar] = []
    # the KV plane's members, as the agents' plane files would list them (the gateway's Members)
    table = MemberTable()
    members: list[Member] = []
    try:
        for wid in ("sgA", "sgB"):
            server = await start_standin(token_delay_ms=15, page_size=PS)
            routes = RequestRoutes(PS)
            auth = PlaneAuth.generate(table)
            store = PageStore(
                PageStoreConfig(
                    worker_id=wid,
                    holder_bind="tcp://127.0.0.1:0",
                    status_bind="tcp://127.0.0.1:0" if report_holders else None,
                    budget_bytes=BUDGET,
                ),
                routes,
                auth=auth,
            )
            members.append(Member(wid, 1, auth.keys.public, store.endpoint))
            table.replace(members)
            stores.append(store)
            tiers[wid] = server.engine.storage = PluginTier(server, store, routes)  # type: ignore[assignment]
            servers[wid] = server
            rec = gw.monitor.attach(
                pb.Hello(
                    worker_id=wid,
                    incarnation=1,
                    engine="sglang",
                    http_url=server.url,
                    kv_endpoint=store.endpoint,
                    ckpt_budget_bytes=BUDGET,
                    kv_capacity_tokens=100_000,
                    phase=pb.SERVING,
                )
            )
            agent = None
            if report_holders:  # the agent's own heartbeats, polling the holder store's status socket
                agent = Sidecar(
                    SidecarConfig(
                        worker_id=wid,
                        url=server.url,
                        gateways=("127.0.0.1:1",),  # never started: the test plays its control session
                        poll_interval_s=0.01,
                        kv_endpoint=store.endpoint,
                        holder_status_endpoint=store.status_endpoint,
                    )
                )
                agent.up = True
                agents.append(agent)
            beats.append(asyncio.create_task(heartbeat(gw, rec, server, agent)))
        await wait_until(lambda: gw.monitor.healthy_count() == 2, 5.0)
        yield gw, servers, tiers
    finally:
        for b in beats:
            b.cancel()
        await gw.stop()
        for s in servers.values():
            await s.stop()
        for st in stores:
            st.close()
        for agent in agents:
            if agent.holders is not None:
                agent.holders.close()


async def heartbeat(gw: Gateway, rec: Any, server: SGLangStandIn, agent: Sidecar | None = None) -> None:
    """The sidecar agent's heartbeats: the server's load, until the server is gone; with `agent`, the
    agent's own beats (its holder report included), taken by the gateway as its control plane does."""
    role = SGLangRole(agent) if agent is not None else None
    seq = 0
    while not server.engine.closed:
        running, waiting = len(server.engine.running), len(server.engine.waiting)
        if role is None or agent is None or agent.holders is None:
            gw.monitor.heartbeat(rec, pb.Heartbeat(phase=pb.SERVING, running=running, waiting=waiting))
        else:
            agent.holder = await agent.holders.poll()
            seq += 1
            beat = role.heartbeat(seq, full=seq == 1)
            beat.running, beat.waiting = running, waiting  # the stand-in serves no /v1/loads
            gw.monitor.heartbeat(rec, beat)
            if gw.monitor.workers.get(rec.id) is rec:
                for hook in gw.control.heartbeat_hooks:
                    hook(rec, beat)
        await asyncio.sleep(0.01)


async def test_an_interrupted_request_resumes_on_its_holder_and_restores_its_pages() -> None:
    async with two_servers_with_holders() as (gw, servers, tiers):
        prompt = [32 + (7 * i) % 90 for i in range(300)]  # 4 full pages of 64, and a tail
        async with aiohttp.ClientSession(f"http://127.0.0.1:{gw.http_port}") as http:
            task = asyncio.create_task(stream_ids(http, prompt, False, 120))
            serving = await wait_for_serving(servers, prompt)
            holder = "sgB" if serving == "sgA" else "sgA"
            # its prompt pages reached the holder's store (written after prefill, as SGLang does)
            keys = page_keys(prompt[: len(prompt) - 1], PS)
            await wait_until(lambda: tiers[holder].store.batch_exists(keys) == len(keys), 5.0)
            await wait_until(
                lambda: all(len(r.output_ids) >= 10 for r in servers[serving].engine.running), 5.0
            )
            await servers[serving].kill()
            ids = await asyncio.wait_for(task, 30.0)
        assert ids == expected_ids(prompt, 120, 0.0)
        assert gw.sessions is not None
        (session,) = gw.sessions.recent_interrupted
        (it,) = session.interruptions
        assert it.worker_id == serving and it.resumed_on == holder and it.action == "restore"
        assert it.restored_tokens >= len(keys) * PS  # the prompt's pages, restored not recomputed
        assert tiers[holder].restored[-1][1] == it.restored_tokens


async def test_the_holders_durable_prefix_reaches_the_gateway_and_dispatch() -> None:
    """The agent reports the holder store's durable tokens for the SGLang rid its pages were filed
    under; the gateway books them on the attempt's checkpoint and dispatch restores for |C_r| > tau."""
    async with two_servers_with_holders(report_holders=True, **{"recovery.tau": 64}) as (gw, servers, tiers):
        prompt = [32 + (7 * i) % 90 for i in range(300)]  # 4 full pages of 64, and a tail
        async with aiohttp.ClientSession(f"http://127.0.0.1:{gw.http_port}") as http:
            task = asyncio.create_task(stream_ids(http, prompt, False, 120))
            serving = await wait_for_serving(servers, prompt)
            holder = "sgB" if serving == "sgA" else "sgA"
            keys = page_keys(prompt[: len(prompt) - 1], PS)
            await wait_until(lambda: tiers[holder].store.batch_exists(keys) == len(keys), 5.0)
            assert gw.checkpoints is not None
            books = gw.checkpoints
            # the holder's report, booked on the attempt's checkpoint (keyed by the SGLang rid)
            await wait_until(
                lambda: any(ck.holders.get(holder, 0) >= len(keys) * PS for ck in books.by_wrid.values()), 5.0
            )
            (ck,) = [ck for ck in books.by_wrid.values() if holder in ck.holders]
            assert ck.wrid == sglang_rid(f"{ck.session_rid}-1") and ck.serving == serving
            assert {live.req.rid for live in servers[serving].engine.running} == {ck.wrid}
            durable = ck.holders[holder]
            assert gw.monitor.workers[holder].ckpt_tokens >= durable
            await wait_until(
                lambda: all(len(r.output_ids) >= 10 for r in servers[serving].engine.running), 5.0
            )
            await servers[serving].kill()
            ids = await asyncio.wait_for(task, 30.0)
        assert ids == expected_ids(prompt, 120, 0.0)
        assert gw.sessions is not None
        (session,) = gw.sessions.recent_interrupted
        (it,) = session.interruptions
        assert it.worker_id == serving and it.resumed_on == holder and it.action == "restore"
        seen = re.search(r"\|C_r\|=(\d+) > tau=64", it.dispatch_reason)  # dispatch saw the durable prefix
        assert seen is not None and int(seen[1]) >= durable >= len(keys) * PS, it.dispatch_reason
        assert it.restored_tokens >= len(keys) * PS
        # the request ended: its checkpoint is dropped from the books
        await wait_until(lambda: ck.wrid not in books.by_wrid, 5.0)


async def wait_for_serving(servers: dict[str, SGLangStandIn], prompt: list[int]) -> str:
    async with asyncio.timeout(5.0):
        while True:
            for wid, s in servers.items():
                if any(live.req.input_ids == prompt for live in s.engine.running):
                    return wid
            await asyncio.sleep(0.005)
