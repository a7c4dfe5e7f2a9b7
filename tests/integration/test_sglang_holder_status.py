"""The holder-status socket of Lumen's page store and the sidecar agent's report of it (issue 14, item 2).

A page store with a holder store (what Lumen's HiCache backend runs in each SGLang rank) answers its
status socket over real ZMQ; a writer page store checkpoints a request's pages to it; the agent polls
the socket and its heartbeats carry the durable tokens as Lumen's own workers' do (deltas, everything in
a session's first beat, bytes used and tokens held), up to the gateway's checkpoint books."""

from __future__ import annotations

import asyncio
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from gateway.protocol import control_pb2 as pb
from gateway.protocol import holder_status as hs
from gateway.protocol.planes import Member, MemberTable, PlaneAuth
from gateway.protocol.secrets import runtime_dir
from tests.integration.test_sglang_agent import gateway, heartbeat, sidecar, standin
from worker_hooks.kv.payload import page_bytes
from worker_hooks.sglang.agent_config import SidecarConfig
from worker_hooks.sglang.agent_role import SGLangRole
from worker_hooks.sglang.holder_report import DurableReporter, HolderPoller, HolderReport, merge
from worker_hooks.sglang.page_routes import RequestRoutes
from worker_hooks.sglang.page_store import PageStore
from worker_hooks.sglang.page_store_config import PageStoreConfig
from worker_hooks.sglang.storage_layout import (
    LumenStorageOptions,
    shard_endpoint,
    shard_layout,
    status_endpoint_for,
)

PS = 16
PAGE_BYTES = 256


@pytest.fixture
def pair() -> Iterator[tuple[PageStore, PageStore, RequestRoutes]]:
    """A holder (with its status socket) and a writer routing to it, members of one table (what their
    agents' plane files list)."""
    table = MemberTable()
    holder_auth, writer_auth = PlaneAuth.generate(table), PlaneAuth.generate(table)
    holder = PageStore(
        PageStoreConfig(
            worker_id="h",
            holder_bind="tcp://127.0.0.1:0",
            status_bind="tcp://127.0.0.1:0",
            budget_bytes=1 << 24,
        ),
        auth=holder_auth,
    )
    routes = RequestRoutes(PS)
    writer = PageStore(PageStoreConfig(worker_id="w"), routes, auth=writer_auth)
    table.replace(
        [Member("h", 0, holder_auth.keys.public, holder.endpoint), Member("w", 0, writer_auth.keys.public)]
    )
    try:
        yield holder, writer, routes
    finally:
        writer.close()
        holder.close()


def checkpoint(writer: PageStore, routes: RequestRoutes, holder: PageStore, rid: str, n_pages: int) -> int:
    ids = [(7 * i + ord(rid[-1])) % 1000 for i in range(n_pages * PS)]
    keys = routes.admit(rid, ids, [holder.endpoint])
    assert all(writer.batch_set(keys, [page_bytes(k, PAGE_BYTES) for k in keys]))
    assert writer.flush(5.0)
    return n_pages * PS


def wait_for(pred: object, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not pred():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def ask(endpoint: str, request: bytes) -> bytes:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 2000)
    sock.connect(endpoint)
    try:
        sock.send(request)
        return bytes(sock.recv())
    finally:
        sock.close(0)


def test_the_status_socket_answers_durable_tokens_per_request_over_zmq(
    pair: tuple[PageStore, PageStore, RequestRoutes],
) -> None:
    holder, writer, routes = pair
    assert holder.status_endpoint.startswith("tcp://127.0.0.1:")
    empty = hs.decode_status(ask(holder.status_endpoint, hs.encode(hs.HolderStatusRequest())))
    assert (empty.bytes_used, empty.tokens_held, empty.durable, empty.truncated) == (0, 0, {}, False)

    a = checkpoint(writer, routes, holder, "rid-a", 3)
    b = checkpoint(writer, routes, holder, "rid-b", 1)
    wait_for(lambda: holder.holder_status().tokens_held == a + b)
    st = hs.decode_status(ask(holder.status_endpoint, hs.encode(hs.HolderStatusRequest())))
    assert st.durable == {"rid-a": a, "rid-b": b}
    assert st.tokens_held == a + b and st.bytes_used == 4 * PAGE_BYTES and st.requests == 2
    assert st.budget_bytes == 1 << 24 and not st.truncated

    # bounded: a smaller answer says it left requests out
    st = hs.decode_status(ask(holder.status_endpoint, hs.encode(hs.HolderStatusRequest(max_requests=1))))
    assert st.durable == {"rid-a": a} and st.truncated and st.requests == 2

    # END: the holder frees the request, and the answer no longer lists it
    writer.finish("rid-a")
    wait_for(lambda: "rid-a" not in holder.holder_status().durable)
    st = hs.decode_status(ask(holder.status_endpoint, hs.encode(hs.HolderStatusRequest())))
    assert st.durable == {"rid-b": b} and st.tokens_held == b

    # another version, or garbage: an error, and the socket keeps answering
    with pytest.raises(ValueError, match="version 99 unsupported"):
        hs.decode_status(ask(holder.status_endpoint, hs.encode(hs.HolderStatusRequest(version=99))))
    with pytest.raises(ValueError, match="bad holder status request"):
        hs.decode_status(ask(holder.status_endpoint, b"\xc1junk"))
    assert hs.decode_status(ask(holder.status_endpoint, msgspec.msgpack.encode({}))).durable == {"rid-b": b}


def test_an_ipc_status_socket_is_for_its_owner_only(tmp_path: Path) -> None:
    """The default status socket is an ipc:// file in the runtime directory: only its owner (the agent runs as the
    server's user) may connect; it answers as over tcp."""
    path = tmp_path / "status.sock"
    holder = PageStore(
        PageStoreConfig(
            worker_id="h", holder_bind="tcp://127.0.0.1:0", status_bind=f"ipc://{path}", budget_bytes=1 << 20
        ),
        auth=PlaneAuth.generate(MemberTable()),
    )
    try:
        assert holder.status_endpoint == f"ipc://{path}"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert (
            hs.decode_status(ask(holder.status_endpoint, hs.encode(hs.HolderStatusRequest()))).bytes_used == 0
        )
    finally:
        holder.close()


def test_the_status_endpoint_is_derived_per_rank_as_the_agent_derives_it() -> None:
    opts = LumenStorageOptions(
        worker_id="s", holder_endpoint="tcp://10.0.0.1:5600", holder_budget_bytes=1 << 30
    )
    base = status_endpoint_for("tcp://10.0.0.1:5600")
    # in the user's own 0700 runtime directory, never a predictable name in /tmp (issue 29)
    assert base.startswith(f"ipc://{runtime_dir()}/holder-status-") and len(base) < 100
    agent = SidecarConfig(
        worker_id="s", url="http://127.0.0.1:1", gateways=("g:1",), tp=2, kv_endpoint="tcp://10.0.0.1:5600"
    )
    ranks = [PageStoreConfig.for_rank(opts, shard_layout(tp_rank=r, tp_size=2)).status_bind for r in range(2)]
    assert ranks == agent.status_endpoints() == [base, base + ".shard1"]
    # an explicit one, for both sides
    opts = LumenStorageOptions(
        worker_id="s", holder_endpoint="tcp://10.0.0.1:5600", status_endpoint="tcp://127.0.0.1:7700"
    )
    assert (
        PageStoreConfig.for_rank(opts, shard_layout(tp_rank=1, tp_size=2)).status_bind
        == "tcp://127.0.0.1:7701"
    )
    agent = SidecarConfig(
        worker_id="s",
        url="http://127.0.0.1:1",
        gateways=("g:1",),
        tp=2,
        kv_endpoint="tcp://10.0.0.1:5600",
        holder_status_endpoint="tcp://127.0.0.1:7700",
    )
    assert agent.status_endpoints() == [shard_endpoint("tcp://127.0.0.1:7700", r) for r in range(2)]
    assert SidecarConfig(worker_id="s", url="http://127.0.0.1:1", gateways=("g:1",)).status_endpoints() == []


def test_ranks_merge_to_the_least_any_rank_holds() -> None:
    def st(
        durable: dict[str, int], truncated: bool = False, used: int = 10, held: int = 0
    ) -> hs.HolderStatus:
        return hs.HolderStatus(bytes_used=used, tokens_held=held, durable=durable, truncated=truncated)

    r = merge([st({"a": 64, "b": 32}, held=96), st({"a": 32}, held=32)], 1)
    assert r.durable == {"a": 32} and r.tokens_held == 32 and r.bytes_used == 20 and r.complete
    # a truncated rank says nothing of what it left out
    r = merge([st({"a": 64, "b": 32}), st({"a": 32}, truncated=True)], 2)
    assert r.durable == {"a": 32, "b": 32} and not r.complete


def test_the_reporter_sends_changes_and_everything_in_a_first_beat() -> None:
    rep = DurableReporter()
    assert rep.beat(None, full=True) == {}
    r1 = HolderReport(1, 0, 0, {"a": 16, "b": 32}, True)
    assert rep.beat(r1, full=False) == {"a": 16, "b": 32}
    assert rep.beat(r1, full=False) == {}  # the same report: nothing new
    r2 = HolderReport(2, 0, 0, {"a": 48}, True)
    assert rep.beat(r2, full=False) == {"a": 48, "b": 0}
    r3 = HolderReport(3, 0, 0, {"c": 16}, False)  # incomplete: "a" is not taken as released
    assert rep.beat(r3, full=False) == {"c": 16}
    assert DurableReporter().beat(r3, full=True) == {"c": 16}


async def test_the_poller_reuses_a_ranks_last_answer_and_never_waits_past_its_timeout(
    pair: tuple[PageStore, PageStore, RequestRoutes],
) -> None:
    holder, writer, routes = pair
    n = checkpoint(writer, routes, holder, "rid-a", 2)
    await asyncio.to_thread(wait_for, lambda: holder.holder_status().tokens_held == n)
    # rank 1 answers nobody (a bound socket that never replies)
    ctx = zmq.Context.instance()
    mute = ctx.socket(zmq.ROUTER)
    mute.setsockopt(zmq.LINGER, 0)
    port = mute.bind_to_random_port("tcp://127.0.0.1")
    poller = HolderPoller([holder.status_endpoint, f"tcp://127.0.0.1:{port}"], timeout_s=0.3)
    try:
        t0 = time.monotonic()
        assert await poller.poll() is None  # not every rank answered yet
        assert time.monotonic() - t0 < 2.0 and poller.failures >= 1
        single = HolderPoller([holder.status_endpoint], timeout_s=1.0)
        try:
            report = await single.poll()
            assert report is not None and report.durable == {"rid-a": n} and report.tokens_held == n
            holder.close()  # the server is gone: the last answer stands until the agent forgets it
            again = await single.poll()
            assert again is report and single.failures >= 1
            single.forget()
            assert single.report is None
        finally:
            single.close()
    finally:
        poller.close()
        mute.close(0)


async def test_the_agents_heartbeats_carry_the_holders_durable_tokens(
    pair: tuple[PageStore, PageStore, RequestRoutes],
) -> None:
    holder, writer, routes = pair
    async with (
        gateway() as gw,
        standin() as server,
        sidecar(
            [gw],
            server.url,
            kv_endpoint=holder.endpoint,
            holder_status_endpoint=holder.status_endpoint,
            ckpt_budget_bytes=1 << 24,
        ) as sc,
    ):
        n = checkpoint(writer, routes, holder, "rid-a", 3)
        beat = await heartbeat(gw, lambda r, hb: any(d.rid == "rid-a" and d.tokens == n for d in hb.durable))
        assert beat.ckpt_tokens_held >= n and beat.ckpt_bytes_used >= 3 * PAGE_BYTES
        # deltas: the next beats say nothing of rid-a until it changes
        quiet = await heartbeat(gw, lambda r, hb: hb.seq > beat.seq + 2)
        assert not any(d.rid == "rid-a" for d in quiet.durable)
        # a new session's first beat reports everything held
        fresh = SGLangRole(sc).heartbeat(1, full=True)
        assert {d.rid: d.tokens for d in fresh.durable} == {"rid-a": n}
        # END: the holder frees it, and the gateway hears 0
        writer.finish("rid-a")
        gone = await heartbeat(gw, lambda r, hb: any(d.rid == "rid-a" and d.tokens == 0 for d in hb.durable))
        assert gone.ckpt_tokens_held == 0 and gone.phase == pb.SERVING


def test_a_page_store_whose_status_endpoint_is_taken_fails() -> None:
    """Issue 29: a status socket that cannot be bound is an error the server stops on (it used to be
    a warning, which let another user's socket answer the agent in its place)."""
    first = PageStore(
        PageStoreConfig(worker_id="a", holder_bind="tcp://127.0.0.1:0", status_bind="tcp://127.0.0.1:0"),
        auth=PlaneAuth.generate(),
    )
    try:
        taken = first.status_endpoint
        with pytest.raises(RuntimeError, match="cannot be bound"):
            PageStore(
                PageStoreConfig(worker_id="b", holder_bind="tcp://127.0.0.1:0", status_bind=taken),
                auth=PlaneAuth.generate(),
            )
    finally:
        first.close()
