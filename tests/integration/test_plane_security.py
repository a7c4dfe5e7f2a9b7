"""The data planes' security (issue 15, item 2; gateway/protocol/planes.py), against real in-process
servers on loopback: a gateway with its gRPC control plane and workers attached through their agents,
so the keys and members are the ones the control plane announces.

The attacks: forged PAGES from a plaintext PUSH (the issue's 200 forged messages with a high
incarnation), from a CURVE client whose key is no member's, from a member under another worker's name,
from a fenced incarnation; and draft rounds from a non-member. None reaches a store or a drafter; each
refusal is counted. The normal paths (checkpoints through the gateway, draft rounds of a member) work.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio
from prometheus_client import generate_latest

from draft_models.client import DraftClient
from draft_models.drafter import DrafterServer
from draft_models.synthetic_drafter import SyntheticDrafter
from gateway.config import load_config
from gateway.protocol import control_pb2 as pb
from gateway.protocol import kv
from gateway.protocol.launch import EngineSpec
from gateway.protocol.plane_file import (
    PLANE_FILE_ENV,
    FileKeyring,
    FileMemberTable,
    PlaneFile,
    auth_from_plane_file,
    read_plane_file,
    write_plane_file,
)
from gateway.protocol.planes import (
    PLAINTEXT,
    CurveKeypair,
    Member,
    MemberTable,
    PlaneAuth,
    PlaneSecurityError,
    curve_client,
    is_key,
)
from gateway.protocol.zap import ZapGuard
from gateway.server.app import Gateway
from worker_hooks.engine.service import Worker, start_worker
from worker_hooks.kv.payload import page_bytes
from worker_hooks.kv.receiver import StoreServer
from worker_hooks.kv.sender import CheckpointSender
from worker_hooks.kv.store import CheckpointStore
from worker_hooks.sglang.page_routes import RequestRoutes
from worker_hooks.sglang.page_store import PageStore
from worker_hooks.sglang.page_store_config import PageStoreConfig
from worker_hooks.sglang.plane_file import ServerPlanes

PS = 64
FORGED = 200
HIGH_INCARNATION = 2**62
# how long the guards here hold a handshake with a key no member has (the product's KEY_WAIT_S is 2 s):
# each refusal below waits it out
KEY_WAIT_S = 0.5


@pytest.fixture(autouse=True)
def _short_key_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ZapGuard, "default_wait_s", KEY_WAIT_S)


async def until(cond: Callable[[], bool], within: float = 10.0, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not cond():
        if loop.time() > deadline:
            raise TimeoutError(f"{what} not met within {within} s")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def cluster(n: int = 2) -> AsyncIterator[tuple[Gateway, list[Worker]]]:
    """A gateway (lumen mode: checkpoints to holders) and n workers attached over its control plane."""
    cfg = load_config(
        overrides={
            "gateway.port": 0,
            "gateway.control_port": 0,
            "timeouts.control_stop_grace_s": 0.05,  # stop() cancels the workers' streams at once
            "recovery.mode": "lumen",
            "health.heartbeat_interval_ms": 50,
            "health.heartbeat_misses": 20,
        }
    )
    gw = Gateway(cfg)
    await gw.start()
    try:
        async with contextlib.AsyncExitStack() as stack:
            workers = []
            for i in range(n):
                spec = EngineSpec(
                    worker_id=f"w{i}",
                    control_address=f"127.0.0.1:{gw.control_port}",
                    control_token=gw.config.gateway.control_token,
                    model="Qwen3-0.6B",
                    time_scale=0.05,
                    heartbeat_interval_ms=50,
                    page_size=16,
                    ckpt_budget_bytes=1 << 34,
                )
                workers.append(await stack.enter_async_context(start_worker(spec)))
            await until(lambda: gw.monitor.healthy_count() == n, 10, "workers healthy")
            # every worker knows every other from the gateway's Members
            await until(
                lambda: all(len(w.engine.planes.members.members()) == n for w in workers), 5, "members"
            )
            yield gw, workers
    finally:
        await gw.stop()


def forged_pages(i: int, *, src_worker: str = "w1", incarnation: int = HIGH_INCARNATION) -> list[bytes]:
    """One forged PAGES message: a page of 64 tokens, well formed, in a real worker's name."""
    ids = [(7 * i + j) % 50_000 for j in range(PS)]
    nbytes = 16 << 10
    header = kv.pages_header(
        rid=f"forged-{i}",
        src_worker=src_worker,
        incarnation=incarnation,
        first_page=0,
        page_size=PS,
        token_ids=ids,
        page_bytes=nbytes,
    )
    return [kv.encode_header(header), page_bytes(f"{i:064x}", nbytes)]


def refused_metric(w: Worker, plane: str, reason: str) -> float:
    text = generate_latest(w.registry).decode()
    for line in text.splitlines():
        if line.startswith(f'lumen_plane_refused_total{{plane="{plane}",reason="{reason}"}}'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no lumen_plane_refused_total for {plane}/{reason}")


def store_of(w: Worker) -> CheckpointStore:
    store = w.engine.ckpt.store
    assert store is not None
    return store


def server_of(w: Worker) -> StoreServer:
    server = w.engine.ckpt.server
    assert server is not None
    return server


# -- the KV plane of a live worker ------------------------------------------------------------------
async def test_forged_pages_from_a_plaintext_push_store_nothing() -> None:
    async with cluster() as (_gw, (w0, _w1)):
        store = store_of(w0)
        before = (store.bytes_used, store.stats().tokens_held, server_of(w0).stats.messages)
        ctx = zmq.asyncio.Context()
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(w0.kv_endpoint)  # what the attacker did, with no key at all
        try:
            for i in range(FORGED):
                with contextlib.suppress(zmq.Again):
                    await push.send_multipart(forged_pages(i), flags=zmq.NOBLOCK)
            await until(lambda: server_of(w0).handshakes_failed >= 1, 5, "the handshake refusal")
            await asyncio.sleep(0.3)
        finally:
            push.close(0)
            ctx.term()
        # nothing reached the store: not a byte, not a token, not even a message to decode
        assert (store.bytes_used, store.stats().tokens_held, server_of(w0).stats.messages) == before
        assert not any(rid.startswith("forged-") for rid in store.rids())
        assert refused_metric(w0, "kv", "handshake") >= 1


async def test_a_curve_client_whose_key_is_no_members_is_refused() -> None:
    async with cluster() as (_gw, (w0, w1)):
        store = store_of(w0)
        server = server_of(w0)
        ctx = zmq.asyncio.Context()
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.setsockopt(zmq.IMMEDIATE, 1)
        # the attacker knows the holder's public key (it is no secret) and brings its own keypair
        curve_client(push, CurveKeypair.generate(), w0.engine.planes.keys.public)
        push.connect(w0.kv_endpoint)
        sent = 0
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + KEY_WAIT_S + 1.5  # held for a Members update, then refused
            while loop.time() < deadline:
                try:
                    await push.send_multipart(
                        forged_pages(sent, src_worker="w1", incarnation=w1.incarnation), flags=zmq.NOBLOCK
                    )
                    sent += 1
                except zmq.Again:  # IMMEDIATE: no connection to queue on
                    await asyncio.sleep(0.05)
        finally:
            push.close(0)
            ctx.term()
        assert sent == 0  # the handshake never completed
        assert server.stats.messages == 0 and store.bytes_used == 0
        assert refused_metric(w0, "kv", "handshake") >= 1


async def test_a_member_cannot_store_pages_in_another_workers_name() -> None:
    async with cluster(3) as (_gw, (w0, w1, w2)):
        server = server_of(w0)
        # w1's own keys and a real connection, but w2's name on the header
        sender = CheckpointSender("w2", w2.incarnation, auth=w1.engine.planes)
        try:
            for i in range(5):
                ids = [(3 * i + j) % 1000 for j in range(16)]
                sender.send_pages(
                    f"spoof-{i}", [w0.kv_endpoint], 0, ids, page_bytes(f"{i:064x}", 256), page_size=16
                )
            await until(lambda: server.stats.impersonated >= 5, 5, "impersonations refused")
        finally:
            await sender.close()
        assert not any(rid.startswith("spoof-") for rid in store_of(w0).rids())
        assert refused_metric(w0, "kv", "impersonated") >= 5


async def test_a_fenced_incarnation_cannot_store_pages_any_more() -> None:
    async with cluster() as (gw, (w0, w1)):
        server, store = server_of(w0), store_of(w0)
        old = w1.incarnation
        # a sender of w1's incarnation, as its engine has one: its pages are stored
        sender = CheckpointSender("w1", old, auth=w1.engine.planes)
        ids = list(range(100, 132))
        try:
            sender.send_pages("before", [w0.kv_endpoint], 0, ids, page_bytes("0" * 64, 2 * 128), page_size=16)
            await until(lambda: store.durable_tokens("before") == 32, 5, "pages of a member")
            # the gateway fences that incarnation (a data connection broke): w0 learns it from Members
            gw.monitor.report_data_failure("w1", old, "test fence")
            members = w0.engine.planes.members
            await until(lambda: (m := members.current("w1")) is None or m.incarnation != old, 5, "the fence")
            # the same, still open connection: nothing more is stored under the fenced incarnation
            sender.send_pages("after", [w0.kv_endpoint], 0, ids, page_bytes("1" * 64, 2 * 128), page_size=16)
            await until(lambda: server.stats.unauthenticated + server.stats.stale_epoch >= 1, 5, "refusal")
            # w1 re-attached as a new incarnation (same process, same key): the old epoch stays refused
            await until(
                lambda: (m := members.current("w1")) is not None and m.incarnation != old, 10, "re-attach"
            )
            stale = server.stats.stale_epoch
            sender.send_pages("stale", [w0.kv_endpoint], 0, ids, page_bytes("2" * 64, 2 * 128), page_size=16)
            await until(lambda: server.stats.stale_epoch > stale, 5, "stale epoch refused")
        finally:
            await sender.close()
        assert store.durable_tokens("after") == 0 and store.durable_tokens("stale") == 0
        assert refused_metric(w0, "kv", "stale_epoch") >= 1
        # and w1's new incarnation checkpoints through w0 as before
        new = CheckpointSender("w1", w1.incarnation, auth=w1.engine.planes)
        try:
            new.send_pages("fresh", [w0.kv_endpoint], 0, ids, page_bytes("3" * 64, 2 * 128), page_size=16)
            await until(lambda: store.durable_tokens("fresh") == 32, 5, "pages of the new incarnation")
        finally:
            await new.close()


async def test_checkpoints_through_the_gateway_still_reach_their_holder() -> None:
    async with cluster() as (gw, workers):
        body = {"model": "lumen-synthetic", "prompt": list(range(40, 240)), "max_tokens": 64, "stream": False}
        async with (
            aiohttp.ClientSession(f"http://127.0.0.1:{gw.http_port}") as http,
            http.post("/v1/completions", json=body) as resp,
        ):
            assert resp.status == 200, await resp.text()
        # its holder's store took the request's full pages (prompt + output - 1 tokens: 16 pages of
        # 16) and its END: CURVE, membership and identity all held (the END freed them again)
        await until(
            lambda: any(server_of(w).stats.pages >= 16 and server_of(w).stats.ends >= 1 for w in workers),
            10,
            "pages and END at the holder",
        )
        for w in workers:
            s = server_of(w).stats
            assert (s.unauthenticated, s.impersonated, s.stale_epoch) == (0, 0, 0)


# -- the draft plane --------------------------------------------------------------------------------
async def test_the_draft_plane_answers_members_only() -> None:
    table = MemberTable()
    target = PlaneAuth.generate(table)
    auth = PlaneAuth.generate(table)
    table.replace([Member("t", 1, target.keys.public), Member("d", 2, auth.keys.public)])
    async with DrafterServer(SyntheticDrafter(1.0), auth=auth, time_scale=0.0) as srv:
        member = DraftClient(srv.endpoint, auth=target, server_key=auth.keys.public)
        stranger = DraftClient(srv.endpoint, auth=PlaneAuth.generate(), server_key=auth.keys.public)
        plain = DraftClient(srv.endpoint, auth=PLAINTEXT)
        try:
            ctx_ids = list(range(32, 96))

            async def ask(c: DraftClient, rnd: int, within_s: float, timeout_s: float = 0.1) -> Any:
                """A round's drafts, asked again (a new round) until `within_s` has passed; None."""
                loop = asyncio.get_running_loop()
                deadline = loop.time() + within_s
                while loop.time() < deadline:
                    c.request(rnd, [c.sync_item("r", ctx_ids, 4)])
                    got = await c.poll(rnd, timeout_s)
                    if got is not None:
                        return got
                    if c.stats.unsent:  # not connected: the send was refused at once
                        await asyncio.sleep(timeout_s)
                    rnd += 1
                return None

            got = await ask(member, 1, 5.0)
            assert got is not None and len(got["r"].tokens) == 4
            # no CURVE at all: the handshake fails, no drafts
            assert await ask(plain, 100, 1.0) is None
            await until(lambda: srv.handshakes_failed >= 1, 2, "the plaintext handshake refused")
            # not a member: held for a Members update, then refused; no drafts
            failed = srv.handshakes_failed
            assert await ask(stranger, 200, KEY_WAIT_S + 1) is None
            await until(lambda: srv.handshakes_failed > failed, 2, "the stranger's handshake refused")
            assert srv.stats.messages == member.stats.rounds  # nothing of theirs was even decoded
            # the target's incarnation is fenced: its open connection gets nothing more
            table.replace([Member("d", 2, auth.keys.public)])
            refused = srv.stats.unauthenticated
            assert await ask(member, 300, 0.5) is None
            assert srv.stats.unauthenticated > refused
        finally:
            for c in (member, stranger, plain):
                c.close()


async def test_a_live_drafter_refuses_a_non_member_and_drafts_for_its_target() -> None:
    async with cluster() as (gw, (w0, _w1)):
        spec = EngineSpec(
            worker_id="d",
            control_address=f"127.0.0.1:{gw.control_port}",
            control_token=gw.config.gateway.control_token,
            model="Qwen3-8B",
            draft_model="Qwen3-0.6B",
            restart=True,
            draft_load_s=0.0,
            model_load_s=1e5,
            time_scale=0.01,
            heartbeat_interval_ms=50,
            ckpt_budget_bytes=0,
        )
        async with start_worker(spec) as d:
            drafter = d.engine.assist.drafter
            assert drafter is not None
            key = d.engine.planes.keys.public
            await until(lambda: w0.engine.planes.members.current("d") is not None, 5, "the drafter a member")
            await until(lambda: d.engine.planes.members.current("w0") is not None, 5, "w0 known to d")
            # w0 is a member: its rounds are answered; a stranger's never are
            ok = DraftClient(d.engine.assist.endpoint, auth=w0.engine.planes, server_key=key)
            evil = DraftClient(d.engine.assist.endpoint, auth=PlaneAuth.generate(), server_key=key)
            try:
                for c in (ok, evil):
                    loop = asyncio.get_running_loop()
                    deadline = loop.time() + KEY_WAIT_S + 1.0  # the stranger: held, then refused
                    r = 0
                    while loop.time() < deadline:
                        r += 1
                        c.request(r, [c.sync_item("x", list(range(40, 90)), 2)])
                        if await c.poll(r, 0.1) is not None:
                            break
                        await asyncio.sleep(0.02)
                assert ok.stats.replies >= 1 and evil.stats.replies == 0
                await until(lambda: drafter.plane_refusals()["handshake"] >= 1, KEY_WAIT_S + 2, "refusal")
            finally:
                ok.close()
                evil.close()
            assert refused_metric(d, "draft", "handshake") >= 1


# -- the control plane's part ----------------------------------------------------------------------
async def test_hello_without_a_plane_key_is_refused_and_members_follow_failures() -> None:
    async with cluster() as (gw, (w0, w1)):
        # the Members every worker got list both, with the keys of their Hellos
        got = {m.worker_id: m for m in w0.engine.planes.members.members()}
        assert got["w1"].key == w1.engine.planes.keys.public == gw.monitor.workers["w1"].plane_key
        assert got["w1"].kv_endpoint == w1.kv_endpoint and got["w1"].incarnation == w1.incarnation
        assert w0.engine.planes.members.gateway_keys() == {gw.control.plane_keys.public}
        # a Hello with no key never attaches
        import grpc

        from gateway.protocol import control_pb2_grpc as pb_grpc
        from gateway.protocol.versions import CONTROL_PROTOCOL_VERSION

        hello = pb.Hello(
            protocol_version=CONTROL_PROTOCOL_VERSION,
            worker_id="nokey",
            incarnation=1,
            http_url="http://127.0.0.1:9",
            auth_token=gw.config.gateway.control_token,
        )
        async with grpc.aio.insecure_channel(f"127.0.0.1:{gw.control_port}") as channel:
            call = pb_grpc.ControlStub(channel).Attach()  # type: ignore[no-untyped-call]
            await call.write(pb.WorkerMessage(hello=hello))
            answer = await asyncio.wait_for(call.read(), 5)
            call.cancel()
        assert answer.WhichOneof("body") == "refuse" and "plane_key" in answer.refuse.reason
        assert "nokey" not in gw.monitor.workers


# -- keys, tables, files ----------------------------------------------------------------------------
def test_keys_and_member_tables() -> None:
    k = CurveKeypair.generate()
    assert is_key(k.public) and is_key(k.secret) and k.secret not in repr(k)
    assert not is_key("~" * 40) and not is_key(k.public[:-1])
    with pytest.raises(PlaneSecurityError):
        CurveKeypair("nope", k.secret)
    t = MemberTable()
    m1 = Member("a", 5, k.public, "tcp://10.0.0.1:5600", "tcp://10.0.0.1:5700")
    t.replace([m1, Member("bad", 1, "not-a-key")], ["junk", k.public])
    assert t.member(k.public) == m1 and t.member("x") is None and t.member(None) is None
    assert t.current("a") == m1 and t.current("bad") is None and t.gateway_keys() == {k.public}
    assert t.allows(k.public, gateways=False)
    # an SGLang holder's rank s listens at its endpoint + s, under the same key
    assert t.server_key("tcp://10.0.0.1:5600") == t.server_key("tcp://10.0.0.1:5603") == k.public
    assert t.server_key("tcp://10.0.0.1:5700") == k.public and t.server_key("tcp://10.0.0.2:5600") is None
    # two gateways (one control session each): the union, the newer incarnation where both list a key
    g1, g2 = object(), object()
    k2 = CurveKeypair.generate().public
    u = MemberTable()
    u.replace([m1], [k.public], source=g1)
    u.replace([Member("a", 6, k.public), Member("b", 1, k2)], [k2], source=g2)
    assert u.member(k.public) == Member("a", 6, k.public) and u.current("b") is not None
    assert u.gateway_keys() == {k.public, k2}
    u.replace([], [], source=g2)  # g2 fenced both: g1's word still stands
    assert u.member(k.public) == m1 and u.member(k2) is None
    u.forget(g1)
    assert u.members() == [] and u.gateway_keys() == frozenset()
    ipc = MemberTable([Member("b", 1, k.public, "ipc:///run/kv.sock")])
    assert ipc.server_key("ipc:///run/kv.sock.shard2") == k.public and ipc.server_key("ipc:///run/x") is None


def test_the_plane_file_is_private_and_followed(tmp_path: Path) -> None:
    path = tmp_path / "d" / "plane.json"
    keys = CurveKeypair.generate()
    other = CurveKeypair.generate()
    write_plane_file(path, PlaneFile({"sg": keys}, [Member("sg", 7, keys.public)], [], 1))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert read_plane_file(path).keys["sg"] == keys
    auth = auth_from_plane_file("sg", path)
    assert auth.keys == keys and auth.members.current("sg") == Member("sg", 7, keys.public)
    with pytest.raises(PlaneSecurityError, match="no keys for worker"):
        auth_from_plane_file("other", path)
    # the agent rewrites it: the members follow
    write_plane_file(
        path, PlaneFile({"sg": keys}, [Member("sg", 8, keys.public), Member("x", 1, other.public)], [], 2)
    )
    table = FileMemberTable(path, recheck_s=0.0)
    assert table.current("sg") is not None and table.current("sg").incarnation == 8  # type: ignore[union-attr]
    # readable by others: refused, as ssh refuses such a key
    os.chmod(path, 0o644)
    with pytest.raises(PlaneSecurityError, match="accessible by other users"):
        read_plane_file(path)
    with pytest.raises(PlaneSecurityError, match=PLANE_FILE_ENV):
        FileKeyring("")


def test_the_agent_writes_its_servers_plane_file(tmp_path: Path) -> None:
    planes = ServerPlanes("sg0")
    try:
        env = planes.env  # what a server it launches gets: the file is written by then
        path = planes.path
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and env == {PLANE_FILE_ENV: str(path)}
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        gw_key = CurveKeypair.generate().public
        msg = pb.Members(
            seq=1,
            members=[pb.PlaneMember(worker_id="sg0", incarnation=3, plane_key=planes.keys.public)],
            gateway_keys=[gw_key],
        )
        planes.update(object(), msg)
        plane = read_plane_file(path)
        assert plane.keys == {"sg0": planes.keys} and [m.incarnation for m in plane.members] == [3]
        assert plane.gateway_keys == [gw_key]
    finally:
        planes.close()
    assert not path.exists()
    # a given path keeps the keys a running server already has
    given = tmp_path / "plane.json"
    first = ServerPlanes("sg1", str(given))
    again = ServerPlanes("sg1", str(given))
    assert again.keys == first.keys
    again.close()
    assert given.exists()  # not the agent's to remove


async def test_a_zap_guard_holds_an_unknown_key_until_the_members_catch_up() -> None:
    table = MemberTable()
    holder = PlaneAuth.generate(table)
    writer = PlaneAuth.generate(table)
    ctx = zmq.asyncio.Context()
    store = CheckpointStore(1 << 20)
    async with StoreServer(store, auth=holder, ctx=ctx) as server:
        table.replace([Member("h", 1, holder.keys.public, server.endpoint)])
        sender = CheckpointSender("w", 4, auth=writer, server_key=lambda e: holder.keys.public)
        try:
            sender.send_pages(
                "late", [server.endpoint], 0, list(range(16)), page_bytes("a" * 64, 64), page_size=16
            )
            guard = server._guard
            assert guard is not None
            await until(lambda: guard.stats.waited >= 1, 5, "the handshake held")  # no member yet
            assert store.durable_tokens("late") == 0
            table.replace(
                [Member("h", 1, holder.keys.public, server.endpoint), Member("w", 4, writer.keys.public)]
            )
            await until(lambda: store.durable_tokens("late") == 16, 5, "the held handshake to complete")
        finally:
            await sender.close()
        # a writer the holder learns of only after its handshake was refused: it retries, and gets in
        later = PlaneAuth.generate(table)
        sender = CheckpointSender("v", 2, auth=later, server_key=lambda e: holder.keys.public)
        try:
            sender.send_pages(
                "later", [server.endpoint], 0, list(range(16)), page_bytes("b" * 64, 64), page_size=16
            )
            await asyncio.sleep(KEY_WAIT_S + 0.3)  # held, then refused
            assert server.handshakes_failed >= 1 and store.durable_tokens("later") == 0
            table.replace([*table.members(), Member("v", 2, later.keys.public)])
            await until(lambda: store.durable_tokens("later") == 16, 10, "the retried handshake")
        finally:
            await sender.close()
        with pytest.raises(PlaneSecurityError, match="already has a policy"):
            ZapGuard.acquire(ctx, "lumen.kv", lambda key: True)
    ctx.term()


# -- SGLang: the page store and the plugin's shipper under the plane file's keys -------------------
async def test_sglang_page_stores_take_pages_only_from_members(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "plane.json"
    a, b, evil = CurveKeypair.generate(), CurveKeypair.generate(), CurveKeypair.generate()
    write_plane_file(path, PlaneFile({"a": a, "b": b, "evil": evil}, [], [], 1))
    monkeypatch.setenv(PLANE_FILE_ENV, str(path))  # what the agent gives a server it launches
    holder = PageStore(PageStoreConfig(worker_id="b", holder_bind="tcp://127.0.0.1:0", budget_bytes=1 << 20))
    routes, evil_routes = RequestRoutes(16), RequestRoutes(16)
    writer = PageStore(PageStoreConfig(worker_id="a"), routes)
    stranger = PageStore(PageStoreConfig(worker_id="evil"), evil_routes)
    try:
        members = [Member("a", 11, a.public), Member("b", 12, b.public, holder.endpoint)]
        write_plane_file(path, PlaneFile({"a": a, "b": b, "evil": evil}, members, [], 2))
        ids = list(range(200, 264))
        keys = routes.admit("r", ids, [holder.endpoint])
        evil_keys = evil_routes.admit("e", [t + 1 for t in ids], [holder.endpoint])
        await asyncio.sleep(0.05)  # the file's mtime is looked at every 20 ms
        assert writer.batch_set(keys, [page_bytes(k, 512) for k in keys]) == [True] * 4
        assert stranger.batch_set(evil_keys, [page_bytes(k, 512) for k in evil_keys]) == [True] * 4
        await until(lambda: holder.batch_exists(keys) == 4, 5, "a member's pages")
        chain = holder.store.chain("r") if holder.store is not None else None
        assert chain is not None and (chain.src_worker, chain.incarnation) == ("a", 11)  # the member's
        await asyncio.sleep(KEY_WAIT_S + 0.5)
        assert holder.batch_exists(evil_keys) == 0  # a key no gateway announced: refused
    finally:
        for s in (writer, stranger, holder):
            s.close()


def test_a_page_store_without_a_plane_file_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PLANE_FILE_ENV, raising=False)
    with pytest.raises(PlaneSecurityError, match=PLANE_FILE_ENV):
        PageStore(PageStoreConfig(worker_id="a", holder_bind="tcp://127.0.0.1:0", budget_bytes=1 << 20))
