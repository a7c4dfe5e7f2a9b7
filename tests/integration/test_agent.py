"""The control-plane agent against a tiny in-test gateway (a real grpc.aio server on loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import msgspec
import pytest

from gateway.protocol import control_pb2 as pb
from gateway.protocol.control_pb2_grpc import ControlServicer, add_ControlServicer_to_server
from gateway.protocol.generate import GenerateRequest, HolderRef, LumenExt, SamplingParams
from gateway.protocol.launch import EngineSpec, encode_spec
from gateway.protocol.versions import CONTROL_PROTOCOL_VERSION
from models.synthetic import expected_output
from tests.fixtures.planes import introduce
from worker_hooks.engine.service import Worker, start_worker


@dataclass
class Session:
    hello: pb.Hello
    heartbeats: list[pb.Heartbeat] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # loop time of each heartbeat
    outbox: asyncio.Queue[pb.GatewayMessage | None] = field(default_factory=asyncio.Queue)


class FakeGateway(ControlServicer):
    """Answers each Attach by the next entry of `script` ("welcome", "refuse", "bad-version"), then
    relays `session.outbox` to the worker; putting None there ends the stream."""

    def __init__(self, script: list[str], heartbeat_ms: int = 20) -> None:
        self.script = list(script)
        self.heartbeat_ms = heartbeat_ms
        self.sessions: list[Session] = []
        self.new_session = asyncio.Condition()

    async def Attach(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        first = await context.read()
        session = Session(hello=first.hello)
        async with self.new_session:
            self.sessions.append(session)
            self.new_session.notify_all()
        action = self.script.pop(0) if self.script else "welcome"
        inc = session.hello.incarnation
        if action == "refuse":
            await context.write(pb.GatewayMessage(incarnation=inc, refuse=pb.Refuse(reason="bad token")))
            return
        version = CONTROL_PROTOCOL_VERSION + (1 if action == "bad-version" else 0)
        welcome = pb.Welcome(
            protocol_version=version, gateway_id="gw-test", heartbeat_interval_ms=self.heartbeat_ms
        )
        await context.write(pb.GatewayMessage(incarnation=inc, welcome=welcome))

        async def reader() -> None:
            while True:
                msg = await context.read()
                if msg is grpc.aio.EOF:
                    return
                session.arrivals.append(asyncio.get_running_loop().time())
                session.heartbeats.append(msg.heartbeat)

        read_task = asyncio.create_task(reader())
        try:
            while (out := await session.outbox.get()) is not None:
                await context.write(out)
        finally:
            read_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await read_task

    async def wait_sessions(self, n: int, within: float = 5.0) -> Session:
        async with asyncio.timeout(within), self.new_session:
            await self.new_session.wait_for(lambda: len(self.sessions) >= n)
        return self.sessions[n - 1]


@contextlib.asynccontextmanager
async def gateway(
    script: list[str] | None = None, heartbeat_ms: int = 20
) -> AsyncIterator[tuple[FakeGateway, str]]:
    servicer = FakeGateway(script or [], heartbeat_ms)
    server = grpc.aio.server()
    add_ControlServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        for s in servicer.sessions:
            s.outbox.put_nowait(None)
        await server.stop(grace=None)


def spec(address: str, **kw: Any) -> EngineSpec:
    base: dict[str, Any] = {
        "worker_id": "w-agent",
        "control_address": address,
        "control_token": "s3cret",
        "model": "Qwen3-0.6B",
        "time_scale": 0.01,
        "failure_domain": "rack-7",
        "ckpt_budget_bytes": 1 << 30,
        "max_running_requests": 32,
        "page_size": 16,
    }
    return EngineSpec(**(base | kw))


async def wait_until(cond: Any, within: float = 5.0) -> None:
    """Poll a condition on engine state (which has no event to wait on) until it holds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not cond():
        if loop.time() > deadline:
            raise TimeoutError(f"condition not met within {within} s")
        await asyncio.sleep(0.005)


async def beats_composed_after_now(session: Session, w: Worker, n: int = 2) -> None:
    """Wait until the gateway has received `n` heartbeats whose contents were read from the engine after
    this call (the beat being written now may carry older state: it counts for nothing)."""
    assert w.agent is not None
    sent = w.agent.heartbeats_sent  # this session's beats so far (tests with one session only)
    await wait_until(lambda: len(session.heartbeats) >= sent + 1 + n)


@pytest.fixture
async def attached() -> AsyncIterator[tuple[FakeGateway, Worker]]:
    async with gateway() as (gw, address), start_worker(spec(address)) as w:
        await gw.wait_sessions(1)
        yield gw, w


async def test_hello_carries_the_worker_description(attached: tuple[FakeGateway, Worker]) -> None:
    gw, w = attached
    h = gw.sessions[0].hello
    assert h.protocol_version == CONTROL_PROTOCOL_VERSION
    assert (h.worker_id, h.incarnation, h.model, h.http_url) == (
        "w-agent",
        w.incarnation,
        "Qwen3-0.6B",
        w.url,
    )
    assert h.kv_capacity_tokens == w.engine.pool.capacity_tokens > 0
    assert (h.page_size, h.max_running_requests, h.pid) == (16, 32, os.getpid())
    assert (h.auth_token, h.failure_domain, h.ckpt_budget_bytes) == ("s3cret", "rack-7", 1 << 30)
    assert h.phase == pb.SERVING
    assert w.agent is not None
    await asyncio.wait_for(w.agent.attached.wait(), 5)
    assert w.agent.gateway_id == "gw-test"


async def test_heartbeats_arrive_at_roughly_the_interval_and_report_load(
    attached: tuple[FakeGateway, Worker],
) -> None:
    gw, w = attached
    session = gw.sessions[0]
    await asyncio.sleep(0.5)
    beats = list(session.heartbeats)
    assert 8 <= len(beats) <= 40  # 20 ms interval: ~25 expected; generous for a loaded CI box
    assert [b.seq for b in beats] == list(range(1, len(beats) + 1))
    assert all(b.phase == pb.SERVING for b in beats)
    assert beats[-1].running == 0 and beats[-1].completed_total == 0

    # the agent reads the same engine: finished requests show up in the heartbeats
    handle = w.engine.submit(
        GenerateRequest(rid="hb", input_ids=[1, 2, 3], sampling_params=SamplingParams(5))
    )
    while (await handle.next()).finish is None:
        pass
    await wait_until(lambda: session.heartbeats[-1].completed_total == 1)


async def test_heartbeats_stay_on_time_while_the_engine_is_busy(attached: tuple[FakeGateway, Worker]) -> None:
    gw, w = attached
    session = gw.sessions[0]
    prompt = [j % 250 for j in range(500)]
    # admission reserves prompt + max_new_tokens of KV: 60 x 5500 tokens fit in this worker
    params = SamplingParams(max_new_tokens=5000, temperature=1.0)
    for i in range(60):
        w.engine.submit(GenerateRequest(rid=f"busy{i}", input_ids=prompt, sampling_params=params))
    start = len(session.arrivals)
    steps = w.engine.stats().steps_total
    await asyncio.sleep(0.5)
    assert w.engine.stats().steps_total - steps > 50  # the engine really was stepping meanwhile
    times = session.arrivals[start:]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # starvation would stretch every gap; one hiccup (a GC pause, a busy CI box) is not what this checks
    assert len(times) >= 10, gaps
    assert sorted(gaps)[len(gaps) * 9 // 10] < 0.06 and max(gaps) < 0.5, gaps
    last = session.heartbeats[-1]  # max_running_requests is 32 in this spec
    assert (last.running, last.waiting) == (32, 28) and last.kv_tokens_used > 32 * 500


async def test_a_fence_resets_the_incarnation_and_reattaches(attached: tuple[FakeGateway, Worker]) -> None:
    gw, w = attached
    old = w.incarnation
    # a request the gateway sent under our epoch, and one a client sent us directly
    slow = w.engine.submit(
        GenerateRequest(
            rid="inflight",
            input_ids=[1] * 8,
            sampling_params=SamplingParams(10**5),
            lumen=LumenExt(epoch=old),
        )
    )
    direct = w.engine.submit(
        GenerateRequest(rid="direct", input_ids=[1] * 8, sampling_params=SamplingParams(20))
    )
    # the gateway declared us failed: it says so (Refuse) and ends the stream
    gw.sessions[0].outbox.put_nowait(pb.GatewayMessage(incarnation=old, refuse=pb.Refuse(reason="fenced")))
    gw.sessions[0].outbox.put_nowait(None)
    second = await gw.wait_sessions(2)
    assert second.hello.incarnation == w.incarnation > old
    while (e := await slow.next()).finish is None:
        pass
    assert e.finish.type == "abort"
    # fencing is the gateway's business: the direct client's stream is not aborted
    while (d := await direct.next()).finish is None:
        pass
    assert d.finish.type == "length" and w.engine.pool.used_pages == 0
    await wait_until(lambda: len(second.heartbeats) >= 2)


async def test_a_stream_that_just_ends_keeps_the_incarnation_and_its_requests(
    attached: tuple[FakeGateway, Worker],
) -> None:
    """The gateway restarted (or died): its requests run on (another gateway may adopt them) and the
    worker attaches again as the same incarnation."""
    gw, w = attached
    old = w.incarnation
    inflight = w.engine.submit(
        GenerateRequest(rid="inflight", input_ids=[1] * 8, sampling_params=SamplingParams(40), lumen=LumenExt(epoch=old))
    )
    gw.sessions[0].outbox.put_nowait(None)  # no Refuse: the stream just ends
    second = await gw.wait_sessions(2)
    assert second.hello.incarnation == w.incarnation == old
    while (e := await inflight.next()).finish is None:
        pass
    assert e.finish.type == "length"


async def test_refuse_is_logged_and_retried_with_a_new_incarnation() -> None:
    async with gateway(["refuse", "welcome"]) as (gw, address), start_worker(spec(address)) as w:
        first = await gw.wait_sessions(1)
        second = await gw.wait_sessions(2)
        assert second.hello.incarnation > first.hello.incarnation
        assert w.agent is not None and w.agent.refusals == 1
        await asyncio.wait_for(w.agent.attached.wait(), 5)
        await wait_until(lambda: len(second.heartbeats) >= 1)


async def test_wrong_control_protocol_version_ends_the_session() -> None:
    async with gateway(["bad-version", "welcome"]) as (gw, address), start_worker(spec(address)):
        first = await gw.wait_sessions(1)
        second = await gw.wait_sessions(2)
        assert not first.heartbeats and second.hello.incarnation > first.hello.incarnation


async def test_messages_for_another_incarnation_are_dropped(attached: tuple[FakeGateway, Worker]) -> None:
    gw, w = attached
    session = gw.sessions[0]
    inc = session.hello.incarnation
    assert w.agent is not None
    handled: list[str | None] = []
    agent_handle = w.agent.handle

    def handle(msg: pb.GatewayMessage) -> None:  # the agent's dispatch, recording what it applied
        handled.append(msg.WhichOneof("body"))
        agent_handle(msg)

    w.agent.handle = handle  # type: ignore[method-assign]
    session.outbox.put_nowait(pb.GatewayMessage(incarnation=inc - 1, drain=pb.Drain()))
    session.outbox.put_nowait(
        pb.GatewayMessage(incarnation=inc, drop_checkpoint=pb.DropCheckpoint(rids=["x"]))
    )
    # one stream, read in order: once the second message is handled, the first was read (and dropped)
    await wait_until(lambda: "drop_checkpoint" in handled)
    assert handled == ["drop_checkpoint"] and w.engine.phase.value == "SERVING"
    session.outbox.put_nowait(pb.GatewayMessage(incarnation=inc, drain=pb.Drain()))
    await wait_until(lambda: bool(session.heartbeats) and session.heartbeats[-1].phase == pb.DRAINING)
    assert w.incarnation == inc  # commands do not end the session


async def test_unreachable_gateway_is_retried_without_resetting() -> None:
    async with gateway() as (_, address):
        pass  # the port is closed again
    async with start_worker(spec(address)) as w:
        inc = w.incarnation
        assert w.agent is not None
        attempts: list[int] = []
        session = w.agent._session

        async def counted() -> None:
            attempts.append(1)
            await session()

        w.agent._session = counted  # type: ignore[method-assign]
        # a second counted attempt starts only after the first failed and the agent went round its loop,
        # where an answered session would have reset the incarnation
        await wait_until(lambda: len(attempts) >= 2)
        assert w.agent.sessions == 0 and w.incarnation == inc


async def test_worker_process_attaches_under_uvloop() -> None:
    async with gateway() as (gw, address):
        text = encode_spec(spec(address, log_level="error"))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "worker_hooks.engine", "--spec", text,
            stdout=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.getcwd()},
        )  # fmt: skip
        try:
            assert proc.stdout is not None
            line = json.loads(await asyncio.wait_for(proc.stdout.readline(), 20))
            session = await gw.wait_sessions(1, within=20)
            assert session.hello.http_url == line["url"] and session.hello.incarnation == line["incarnation"]
            await wait_until(lambda: len(session.heartbeats) >= 3)
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 10) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


# -- the checkpoint plane in heartbeats -------------------------------------------------------------------
KV_PER_TOKEN = 114688  # Qwen3-0.6B, the model of `spec`


def latest_durable(session: Session) -> dict[str, int]:
    """Durable tokens per request as a gateway folding the heartbeat deltas in order sees them."""
    out: dict[str, int] = {}
    for beat in list(session.heartbeats):
        for d in beat.durable:
            out[d.rid] = d.tokens
    return out


def checkpointed(rid: str, prompt: list[int], holder: Worker, max_new: int = 10**5) -> GenerateRequest:
    ref = HolderRef(worker_id=holder.worker_id, kv_endpoint=holder.kv_endpoint)
    return GenerateRequest(
        rid=rid, input_ids=prompt, sampling_params=SamplingParams(max_new), lumen=LumenExt(checkpoint=[ref])
    )


async def test_heartbeats_report_the_checkpoint_plane(attached: tuple[FakeGateway, Worker]) -> None:
    gw, w = attached
    session = gw.sessions[0]
    assert session.hello.kv_endpoint == w.kv_endpoint and w.kv_endpoint.startswith("tcp://127.0.0.1:")
    store = w.engine.ckpt.store
    assert store is not None
    prompt = list(range(40, 80))
    async with start_worker(spec("", worker_id="w-peer")) as peer:
        introduce(w, peer)  # the gateway's Members: their KV planes trust each other
        # peer serves a request whose holder is w: w's heartbeats report what it holds
        peer.engine.submit(checkpointed("p-1", prompt, w))
        await wait_until(lambda: latest_durable(session).get("p-1", 0) >= 64)
        peer.engine.pause()
        await asyncio.sleep(0.05)  # the step in flight delivers; then nothing moves
        seq = peer.engine.scheduler.get("p-1")
        assert seq is not None
        held = seq.kv_len // 16 * 16  # the full pages of the KV computed so far
        peer.engine.abort("p-1", "worker failed")
        peer.engine.resume()
        await wait_until(lambda: latest_durable(session).get("p-1") == held)
        await wait_until(lambda: session.heartbeats[-1].ckpt_tokens_held == held)
        assert session.heartbeats[-1].ckpt_bytes_used == held * KV_PER_TOKEN  # modelled bytes

        # the gateway resumes on the holder: w restores the prompt's full pages, less the last token
        handle = w.engine.submit(checkpointed("p-2", prompt, peer, max_new=30))
        assert handle.restored_tokens == 32
        while (await handle.next()).finish is None:
            pass
        # w streamed p-2 (restored pages included) to peer: floor((40 + 30 - 1) / 16) pages
        await wait_until(lambda: session.heartbeats[-1].ckpt_bytes_sent_total == 4 * 16 * KV_PER_TOKEN)
        last = session.heartbeats[-1]
        assert (last.restores_total, last.restored_tokens_total, last.ckpt_pages_evicted_total) == (1, 32, 0)

    # a new session (the gateway restarted, or fenced us) starts with the whole durable state
    gw.sessions[0].outbox.put_nowait(None)
    second = await gw.wait_sessions(2)
    await wait_until(lambda: len(second.heartbeats) >= 1)
    assert {d.rid: d.tokens for d in second.heartbeats[0].durable} == {"p-1": held}

    second.outbox.put_nowait(
        pb.GatewayMessage(incarnation=w.incarnation, drop_checkpoint=pb.DropCheckpoint(rids=["p-1"]))
    )
    await wait_until(lambda: latest_durable(second).get("p-1") == 0)
    await wait_until(lambda: second.heartbeats[-1].ckpt_bytes_used == 0)
    assert store.bytes_used == 0


async def test_abandoned_checkpoints_are_reported() -> None:
    # a lag bound below one prefill's pages: the checkpoint is abandoned at once, and reported once
    async with gateway() as (gw, address), start_worker(spec(address, ckpt_max_lag_bytes=4096)) as w:
        session = await gw.wait_sessions(1)
        ref = HolderRef(worker_id="gone", kv_endpoint="tcp://127.0.0.1:9")
        w.engine.submit(
            GenerateRequest(
                rid="lagging",
                input_ids=[1] * 64,
                sampling_params=SamplingParams(10**5),
                lumen=LumenExt(checkpoint=[ref]),
            )
        )
        await wait_until(lambda: any("lagging" in b.abandoned_checkpoints for b in session.heartbeats))
        await beats_composed_after_now(session, w, 3)
        assert sum(list(b.abandoned_checkpoints).count("lagging") for b in session.heartbeats) == 1


# -- draft assist over the control plane --------------------------------------------------------------
DRAFTED = {"model": "Qwen3-8B", "draft_model": "Qwen3-0.6B"}


async def test_a_restarting_worker_announces_its_drafter_and_reports_its_phases() -> None:
    s = spec("", worker_id="w-d", restart=True, draft_load_s=10.0, model_load_s=30.0, **DRAFTED)
    async with (
        gateway() as (gw, address),
        start_worker(msgspec.structs.replace(s, control_address=address)) as w,
    ):
        session = await gw.wait_sessions(1)
        h = session.hello
        assert h.phase == pb.LOADING_DRAFT and h.draft_model == "Qwen3-0.6B"
        assert h.draft_endpoint == w.engine.assist.endpoint != ""
        inc = h.incarnation
        await wait_until(lambda: bool(session.heartbeats) and session.heartbeats[-1].phase == pb.DRAFT_READY)
        session.outbox.put_nowait(
            pb.GatewayMessage(
                incarnation=inc,
                start_draft_assist=pb.StartDraftAssist(peer_id="w-t", role="drafter", k=4),
            )
        )
        drafter = w.engine.assist.drafter
        assert drafter is not None
        await wait_until(lambda: drafter.peers == {"w-t"})
        await wait_until(lambda: session.heartbeats[-1].phase == pb.SERVING)
        # serving now; the drafter lingers until the gateway ends the pair, then retires
        assert w.engine.assist.endpoint != ""
        session.outbox.put_nowait(
            pb.GatewayMessage(incarnation=inc, stop_draft_assist=pb.StopDraftAssist(peer_id="w-t"))
        )
        await wait_until(lambda: w.engine.assist.endpoint == "")
        phases = [b.phase for b in session.heartbeats]
        order = [p for i, p in enumerate(phases) if i == 0 or phases[i - 1] != p]
        assert order == [pb.LOADING_DRAFT, pb.DRAFT_READY, pb.SERVING]


async def test_heartbeats_carry_the_targets_draft_stats() -> None:
    drafter_spec = spec(
        "", worker_id="w-d", restart=True, draft_load_s=0.0, model_load_s=1e5, ckpt_budget_bytes=0, **DRAFTED
    )
    async with (
        gateway() as (gw, address),
        start_worker(spec(address, **DRAFTED)) as w,
        start_worker(drafter_spec) as d,
    ):
        session = await gw.wait_sessions(1)
        await wait_until(lambda: d.engine.phase.value == "DRAFT_READY")
        introduce(w, d)  # the gateway's Members: the drafter admits the target, which knows its key
        assert session.hello.draft_endpoint == ""  # a worker that is not restarting drafts for nobody
        start = pb.StartDraftAssist(peer_id="w-d", peer_endpoint=d.engine.assist.endpoint, role="target", k=3)
        session.outbox.put_nowait(pb.GatewayMessage(incarnation=w.incarnation, start_draft_assist=start))
        await wait_until(lambda: w.engine.assist.speculator is not None)
        prompt = [32 + j % 90 for j in range(100)]
        params = SamplingParams(max_new_tokens=300, temperature=0.0)
        handle = w.engine.submit(GenerateRequest(rid="assisted", input_ids=prompt, sampling_params=params))
        out: list[int] = []
        while (e := await handle.next()).finish is None:
            out.extend(e.new_ids)
        out.extend(e.new_ids)
        assert out == expected_output(prompt, params)[0]
        totals = w.engine.assist.totals()
        assert totals.accepted > 0
        want = pb.DraftStats(
            drafted_tokens=totals.drafted, accepted_tokens=totals.accepted, rounds=totals.rounds
        )
        await wait_until(lambda: session.heartbeats[-1].draft == want)
        d_stats = session.heartbeats[-1].draft
        assert d_stats.drafted_tokens >= d_stats.accepted_tokens and d_stats.rounds > 0
        session.outbox.put_nowait(
            pb.GatewayMessage(incarnation=w.incarnation, stop_draft_assist=pb.StopDraftAssist(peer_id="w-d"))
        )
        await wait_until(lambda: w.engine.assist.speculator is None)
        await beats_composed_after_now(session, w)
        assert session.heartbeats[-1].draft == d_stats  # totals outlive the pair
