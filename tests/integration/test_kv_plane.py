"""The KV checkpoint plane over real ZMQ sockets: sender -> receiver -> store (tcp:// and ipc://)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import numpy as np
import pytest
import structlog
import zmq
import zmq.asyncio

from gateway.protocol import kv
from gateway.protocol.pagekeys import page_keys
from gateway.protocol.planes import PLAINTEXT
from gateway.protocol.versions import KV_PROTOCOL_VERSION
from worker_hooks.kv.payload import page_bytes, pages_payload, verify
from worker_hooks.kv.receiver import StoreServer
from worker_hooks.kv.sender import CheckpointSender
from worker_hooks.kv.store import CheckpointStore

PS = 16
PB = 4096


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)  # closes what a failed test left open, so teardown cannot hang


@pytest.fixture(params=["tcp", "ipc"])
def bind_to(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return "tcp://127.0.0.1:0" if request.param == "tcp" else f"ipc://{tmp_path}/kv.sock"


async def until(cond: Callable[[], bool], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


# -- codec ----------------------------------------------------------------------------------------
def header(**kw: object) -> kv.KvHeader:
    base: dict[str, object] = dict(rid="r", src_worker="w", incarnation=1, first_page=0, page_size=2)
    base.update(kw)
    return kv.pages_header(token_ids=[1, 2, 3, 4], page_bytes=8, **base)  # type: ignore[arg-type]


def test_codec_round_trip_and_validation() -> None:
    h = header()
    frames = kv.encode(h, b"x" * 16)
    got, payload = kv.decode([bytes(frames[0]), bytes(frames[1])])
    assert got == h and got.n_pages == 2 and bytes(payload) == b"x" * 16
    with pytest.raises(kv.KvProtocolError, match="payload is 15 B"):
        kv.decode([bytes(frames[0]), b"x" * 15])
    end = kv.control_header(kv.KvType.END, rid="r", src_worker="w", incarnation=1)
    assert kv.decode(kv.encode(end))[0].type is kv.KvType.END
    with pytest.raises(kv.KvProtocolError, match="empty payload"):
        kv.decode(kv.encode(end, b"x"))
    with pytest.raises(kv.KvProtocolError, match="2 frames"):
        kv.decode([bytes(frames[0])])


def test_wrong_version_is_a_clear_error() -> None:
    raw = msgspec.msgpack.encode({**msgspec.structs.asdict(header()), "v": KV_PROTOCOL_VERSION + 1})
    with pytest.raises(kv.KvProtocolError, match=f"version {KV_PROTOCOL_VERSION + 1} is not supported"):
        kv.decode_header(raw)
    for bad in (b"\xc1garbage", msgspec.msgpack.encode({"v": 1, "type": "PAGES"}), b""):
        with pytest.raises(kv.KvProtocolError, match="malformed"):
            kv.decode_header(bad)


# -- sender -> receiver -> store ------------------------------------------------------------------
async def test_many_requests_sharing_prefixes_stream_dedupe_and_end_frees(
    ctx: zmq.asyncio.Context, bind_to: str
) -> None:
    store = CheckpointStore(1 << 30)
    async with StoreServer(store, bind_to, auth=PLAINTEXT, ctx=ctx) as server:
        sender = CheckpointSender("w0", 1, auth=PLAINTEXT, ctx=ctx, frame_bytes=64 << 10)
        system = list(range(3 * PS))  # 3 shared pages
        reqs = {f"r{i}": system + list(range(1000 * (i + 1), 1000 * (i + 1) + 4 * PS)) for i in range(20)}
        payloads = {rid: pages_payload(ids, PS, PB) for rid, ids in reqs.items()}
        # the prompt as one prefill chunk, then one page per "decode" round, interleaved
        for rid, ids in reqs.items():
            sender.send_pages(
                rid, [server.endpoint], 0, ids[: 4 * PS], payloads[rid][1][: 4 * PB], page_size=PS
            )
        for p in range(4, 7):
            for rid, ids in reqs.items():
                data = memoryview(payloads[rid][1])[p * PB : (p + 1) * PB]
                sender.send_pages(rid, [server.endpoint], p, ids[p * PS : (p + 1) * PS], data, page_size=PS)
        await until(lambda: all(store.durable_tokens(r) == 7 * PS for r in reqs))
        stats = store.stats()
        assert (stats.pages, stats.requests, stats.bytes_used) == (3 + 20 * 4, 20, (3 + 80) * PB)
        store.check_integrity()
        n, data = store.longest_prefix([*reqs["r7"], 5, 5], PS)
        assert n == 7 * PS and all(verify(k, d) for k, d in zip(payloads["r7"][0], data, strict=True))
        assert server.stats.refused == 0
        for rid in reqs:
            sender.end(rid)
        await until(lambda: store.stats().pages == 0)
        assert store.bytes_used == 0 and server.stats.ends == 20
        assert sender.caller_cost().calls == 80
        await sender.close()


async def test_drop_frees_and_grouping_makes_large_frames(ctx: zmq.asyncio.Context, bind_to: str) -> None:
    store = CheckpointStore(1 << 30)
    async with StoreServer(store, bind_to, auth=PLAINTEXT, ctx=ctx) as server:
        sender = CheckpointSender("w0", 1, auth=PLAINTEXT, ctx=ctx, frame_bytes=16 * PB, linger_s=0.05)
        ids = list(range(32 * PS))
        _, payload = pages_payload(ids, PS, PB)
        for p in range(32):  # 32 single-page calls in one burst -> 2 frames of 16 pages
            data = payload[p * PB : (p + 1) * PB]
            sender.send_pages("r", [server.endpoint], p, ids[p * PS : (p + 1) * PS], data, page_size=PS)
        await until(lambda: store.durable_tokens("r") == 32 * PS)
        assert sender.stats()[server.endpoint].frames == 2
        assert server.stats.messages == 2
        sender.drop("r")
        await until(lambda: store.stats().pages == 0)
        assert server.stats.drops == 1
        await sender.close()


async def test_grouped_frames_reuse_staging_buffers_without_corrupting_pages(
    ctx: zmq.asyncio.Context, bind_to: str
) -> None:
    store = CheckpointStore(1 << 30)
    async with StoreServer(store, bind_to, auth=PLAINTEXT, ctx=ctx) as server:
        sender = CheckpointSender("w0", 1, auth=PLAINTEXT, ctx=ctx, frame_bytes=4 * PB, sndhwm=2)
        reqs = {f"r{i}": list(range(10_000 * i, 10_000 * i + 40 * PS)) for i in range(6)}
        for p in range(40):  # interleaved single pages: many grouped frames through few buffers
            for rid, ids in reqs.items():
                _, data = pages_payload(ids[: (p + 1) * PS], PS, PB)
                sender.send_pages(
                    rid, [server.endpoint], p, ids[p * PS : (p + 1) * PS], data[p * PB :], page_size=PS
                )
            await asyncio.sleep(0)
        await until(lambda: all(store.durable_tokens(r) == 40 * PS for r in reqs))
        for ids in reqs.values():
            keys = page_keys(ids, PS)
            n, pages = store.longest_prefix(ids, PS)
            assert n == 40 * PS and all(verify(k, d) for k, d in zip(keys, pages, strict=True))
        assert sender.stats()[server.endpoint].frames < 6 * 40
        await sender.close()


async def test_a_lagging_holder_gets_the_request_abandoned_without_blocking_the_caller(
    ctx: zmq.asyncio.Context,
) -> None:
    # a holder that accepts the connection and never reads
    lagging = ctx.socket(zmq.PULL)
    lagging.setsockopt(zmq.RCVHWM, 1)
    lagging.setsockopt(zmq.RCVBUF, 64 << 10)
    lagging.bind("tcp://127.0.0.1:0")
    endpoint = lagging.getsockopt_string(zmq.LAST_ENDPOINT)
    sender = CheckpointSender("w0", 1, auth=PLAINTEXT, ctx=ctx, max_lag_bytes=1 << 20, sndhwm=1, frame_bytes=64 << 10)
    page = page_bytes("ab" * 32, 64 << 10)
    worst = 0.0
    for step in range(400):  # 400 x 64 KiB = 25 MiB toward a holder that reads nothing
        for r in range(4):
            t0 = time.perf_counter()
            sender.send_pages(f"r{r}", [endpoint], step, list(range(PS)), page, page_size=PS)
            worst = max(worst, time.perf_counter() - t0)
        await asyncio.sleep(0)  # the decode loop yields once per step
    gone = sender.abandoned()
    assert {a.rid for a in gone} == {"r0", "r1", "r2", "r3"} and all(a.endpoint == endpoint for a in gone)
    assert sender.abandoned() == []
    assert sender.queued_bytes(endpoint) <= (1 << 20) + (64 << 10)
    assert worst < 0.05, f"send_pages took {worst * 1e3:.1f} ms"
    assert sender.caller_cost().p50_us < 1000
    await sender.close()
    lagging.close(0)


async def test_bad_messages_are_refused_and_logged_and_the_loop_keeps_working(
    ctx: zmq.asyncio.Context, bind_to: str
) -> None:
    store = CheckpointStore(1 << 20)
    async with StoreServer(store, bind_to, auth=PLAINTEXT, ctx=ctx) as server:
        raw = ctx.socket(zmq.PUSH)
        raw.connect(server.endpoint)
        ids = list(range(PS))
        _, payload = pages_payload(ids, PS, PB)
        good = kv.pages_header(
            rid="r", src_worker="w", incarnation=1, first_page=0, page_size=PS, token_ids=ids, page_bytes=PB
        )
        wrong_version = msgspec.msgpack.encode({**msgspec.structs.asdict(good), "type": "PAGES", "v": 99})
        with structlog.testing.capture_logs() as logs:
            await raw.send_multipart([wrong_version, payload])
            await raw.send_multipart([b"not msgpack", payload])
            await raw.send_multipart([kv.encode_header(good)])  # payload frame missing
            await raw.send_multipart([kv.encode_header(good), payload[:-1]])  # short payload
            bad_parent = msgspec.structs.replace(good, parent_key="zz" * 32)
            await raw.send_multipart([kv.encode_header(bad_parent), payload])
            await raw.send_multipart([kv.encode_header(good), payload])
            await until(lambda: store.durable_tokens("r") == PS)
        refused = [e for e in logs if e["event"] == "kv_message_refused"]
        assert server.stats.refused == 5 and len(refused) == 5
        assert "version 99 is not supported" in refused[0]["reason"]
        assert refused[0]["log_level"] == "warning"
        assert store.longest_prefix(ids, PS) == (PS, [memoryview(payload)])
        raw.close(0)


async def test_a_restarted_worker_fences_its_old_incarnation(ctx: zmq.asyncio.Context) -> None:
    store = CheckpointStore(1 << 20)
    async with StoreServer(store, auth=PLAINTEXT, ctx=ctx) as server:
        old = CheckpointSender("w0", 1, auth=PLAINTEXT, ctx=ctx)
        new = CheckpointSender("w0", 2, auth=PLAINTEXT, ctx=ctx)
        ids = list(range(3 * PS))
        keys, payload = pages_payload(ids, PS, PB)
        new.send_pages("r", [server.endpoint], 0, ids[:PS], payload[:PB], page_size=PS)
        await until(lambda: store.durable_tokens("r") == PS)
        old.send_pages("r", [server.endpoint], 1, ids[PS : 2 * PS], payload[PB : 2 * PB], page_size=PS)
        await until(lambda: server.stats.stale == 1)
        old.drop("r")  # a late DROP of the old incarnation frees nothing
        await until(lambda: server.stats.drops == 1)
        info = store.chain("r")
        assert info is not None and (info.incarnation, info.pages) == (2, 1)
        assert store.longest_prefix(ids, PS)[1] == [memoryview(payload)[:PB]]
        assert page_keys(ids, PS) == keys
        await old.close()
        await new.close()


async def test_numpy_token_ids_and_payloads_go_through_unchanged(ctx: zmq.asyncio.Context) -> None:
    store = CheckpointStore(1 << 20)
    async with StoreServer(store, auth=PLAINTEXT, ctx=ctx) as server:
        sender = CheckpointSender("w0", 1, auth=PLAINTEXT, ctx=ctx)
        ids = np.arange(5, 5 + 2 * PS, dtype=np.int64)
        kv_pages = np.linspace(-1, 1, 2 * 64, dtype=np.float16).reshape(2, 64)  # 2 pages of 128 B
        sender.send_pages(
            "r", [server.endpoint], 0, ids, memoryview(kv_pages), page_size=PS, dtype="float16", shape=[64]
        )
        await until(lambda: store.durable_tokens("r") == 2 * PS)
        n, pages = store.longest_prefix(ids.tolist(), PS)
        assert n == 2 * PS and b"".join(pages) == kv_pages.tobytes()
        await sender.close()
