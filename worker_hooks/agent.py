"""The worker's control-plane client: attach to the gateway, heartbeat, obey commands (DESIGN 4.3).

One session = one `Attach` stream: Hello -> Welcome (or Refuse) -> a Heartbeat every interval, while
gateway messages are read and dispatched. Heartbeats are scheduled by absolute deadlines, so a busy
event loop delays one beat but never shifts the whole train.

When a session that the gateway answered ends for any reason (gateway restarted, or it declared this
worker failed and cancelled the stream), the gateway no longer trusts our in-flight requests: the
engine resets its incarnation (aborting them) and the agent re-attaches with exponential backoff.
Attempts that never reached the gateway do not reset again. Gateway messages for another incarnation
are dropped.

Heartbeats carry the checkpoint plane's state in modelled bytes: the store's use, the durable tokens
of every held request that changed since the previous beat (all of them in a session's first beat,
so a restarted gateway learns the whole state), and the checkpoints the sender abandoned; and the
worker's draft-assist totals as a target (`DraftStats`: drafts verified, accepted, assisted steps).

Hello carries `draft_endpoint` while the worker runs a drafter: a restarting worker with a draft model
binds its drafter before it attaches, so the gateway knows where to send targets once it reports
DRAFT_READY. StartDraftAssist / StopDraftAssist go to the engine's assist roles.
"""

from __future__ import annotations

import asyncio
import os

import grpc
import structlog

from gateway.protocol import control_pb2 as pb
from gateway.protocol.control_pb2_grpc import ControlStub
from gateway.protocol.launch import EngineSpec
from gateway.protocol.versions import CONTROL_PROTOCOL_VERSION
from worker_hooks.engine.engine import Engine

log = structlog.get_logger(__name__)

BACKOFF_START_S = 0.05
BACKOFF_CAP_S = 1.0
WELCOME_TIMEOUT_S = 5.0


class SessionEnded(Exception):
    """The gateway closed the stream or refused us; carries why, for the log."""


class Agent:
    def __init__(
        self,
        spec: EngineSpec,
        engine: Engine,
        http_url: str,
        *,
        backoff_start_s: float = BACKOFF_START_S,
        backoff_cap_s: float = BACKOFF_CAP_S,
        welcome_timeout_s: float = WELCOME_TIMEOUT_S,
    ) -> None:
        self.spec = spec
        self.engine = engine
        self.http_url = http_url
        self.backoff_start_s = backoff_start_s
        self.backoff_cap_s = backoff_cap_s
        self.welcome_timeout_s = welcome_timeout_s
        self.gateway_id = ""
        self.attached = asyncio.Event()  # set while a welcomed session is live
        self.sessions = 0  # Hellos sent
        self.refusals = 0
        self.heartbeats_sent = 0
        self._task: asyncio.Task[None] | None = None
        self._answered = False  # whether the current session got an answer from the gateway

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("agent already started")
        self._task = asyncio.create_task(self._run(), name=f"agent-{self.engine.worker_id}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        self.attached.clear()

    # -- the reconnect loop ---------------------------------------------------------------------
    async def _run(self) -> None:
        backoff = self.backoff_start_s
        while True:
            self._answered = False
            try:
                await self._session()
            except SessionEnded as exc:
                log.warning("control session ended", worker_id=self.engine.worker_id, reason=str(exc))
            except (grpc.RpcError, TimeoutError, asyncio.InvalidStateError) as exc:
                # while the gateway stays unreachable, only the first failure is worth an info line
                (log.info if backoff == self.backoff_start_s else log.debug)(
                    "control stream failed",
                    worker_id=self.engine.worker_id,
                    address=self.spec.control_address,
                    error=_describe(exc),
                )
            except Exception:
                # the outermost loop of the agent: log, and treat it like a broken stream
                log.exception("control session crashed", worker_id=self.engine.worker_id)
            self.attached.clear()
            if self._answered:
                # the gateway knew this incarnation; whatever it had in flight here is void now
                self.engine.reset_incarnation()
                backoff = self.backoff_start_s
            await asyncio.sleep(backoff)
            backoff = min(self.backoff_cap_s, backoff * 2)

    async def _session(self) -> None:
        """Run one Attach stream until it ends; always ends by raising."""
        async with grpc.aio.insecure_channel(self.spec.control_address) as channel:
            call = ControlStub(channel).Attach()  # type: ignore[no-untyped-call]  # generated stub
            incarnation = self.engine.incarnation
            tasks: list[asyncio.Task[None]] = []
            try:
                await call.write(pb.WorkerMessage(hello=self._hello(incarnation)))
                self.sessions += 1
                first = await asyncio.wait_for(self._read(call, incarnation), self.welcome_timeout_s)
                if first is None:
                    raise SessionEnded("stream closed before Welcome")
                self._answered = True
                if first.WhichOneof("body") == "refuse":
                    self.refusals += 1
                    raise SessionEnded(f"refused: {first.refuse.reason}")
                if first.WhichOneof("body") != "welcome":
                    raise SessionEnded(f"expected Welcome, got {first.WhichOneof('body')}")
                welcome = first.welcome
                if welcome.protocol_version != CONTROL_PROTOCOL_VERSION:
                    raise SessionEnded(
                        f"gateway speaks control protocol {welcome.protocol_version}, "
                        f"this worker {CONTROL_PROTOCOL_VERSION}"
                    )
                self.gateway_id = welcome.gateway_id
                interval_ms = welcome.heartbeat_interval_ms or self.spec.heartbeat_interval_ms
                log.info(
                    "attached",
                    worker_id=self.engine.worker_id,
                    gateway=welcome.gateway_id,
                    incarnation=incarnation,
                    heartbeat_ms=interval_ms,
                )
                self.attached.set()
                tasks = [
                    asyncio.create_task(self._heartbeats(call, interval_ms / 1000.0)),
                    asyncio.create_task(self._dispatch(call, incarnation)),
                ]
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    try:
                        t.result()  # re-raise what ended the session
                    except asyncio.InvalidStateError as exc:
                        # a heartbeat written after the gateway finished the call
                        raise SessionEnded("stream closed by the gateway") from exc
                raise SessionEnded("stream closed by the gateway")
            finally:
                for t in tasks:
                    t.cancel()
                # the tasks' own errors were re-raised above (or are moot once we are cancelled)
                await asyncio.gather(*tasks, return_exceptions=True)
                call.cancel()

    # -- one session's parts --------------------------------------------------------------------
    def _hello(self, incarnation: int) -> pb.Hello:
        spec = self.spec
        return pb.Hello(
            protocol_version=CONTROL_PROTOCOL_VERSION,
            worker_id=self.engine.worker_id,
            incarnation=incarnation,
            model=spec.model,
            draft_model=spec.draft_model,
            http_url=self.http_url,
            kv_endpoint=self.engine.ckpt.endpoint,
            draft_endpoint=self.engine.assist.endpoint,
            kv_capacity_tokens=self.engine.pool.capacity_tokens,
            ckpt_budget_bytes=self.engine.ckpt.stats().budget_bytes,
            failure_domain=spec.failure_domain,
            auth_token=spec.control_token,
            page_size=spec.page_size,
            pid=os.getpid(),
            max_running_requests=spec.max_running_requests,
            phase=pb.Phase.Value(self.engine.phase.value),
        )

    async def _read(self, call: grpc.aio.StreamStreamCall, incarnation: int) -> pb.GatewayMessage | None:
        """The next message for `incarnation`, or None at the end of the stream."""
        while True:
            msg = await call.read()
            if msg is grpc.aio.EOF:
                return None
            if not isinstance(msg, pb.GatewayMessage):
                raise SessionEnded(f"unexpected stream item {type(msg).__name__}")
            if msg.incarnation == incarnation:
                return msg
            log.warning(
                "dropped message for another incarnation",
                worker_id=self.engine.worker_id,
                body=msg.WhichOneof("body"),
                for_incarnation=msg.incarnation,
                ours=incarnation,
            )

    async def _heartbeats(self, call: grpc.aio.StreamStreamCall, interval_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        seq = 0
        while True:
            delay = deadline - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            seq += 1
            await call.write(pb.WorkerMessage(heartbeat=self.heartbeat(seq, full=seq == 1)))
            self.heartbeats_sent += 1
            deadline += interval_s
            now = loop.time()
            if deadline < now - interval_s:
                # more than a whole interval behind (a stalled loop): skip the missed beats
                deadline = now

    def heartbeat(self, seq: int, *, full: bool = False) -> pb.Heartbeat:
        """The engine's state now; `full` reports every held checkpoint, not only the changes."""
        s = self.engine.stats()
        ckpt = self.engine.ckpt
        c = ckpt.stats()
        d = self.engine.assist.totals()
        return pb.Heartbeat(
            seq=seq,
            phase=pb.Phase.Value(s.phase.value),
            running=s.running,
            waiting=s.waiting,
            kv_tokens_used=s.kv_tokens_used,
            completed_total=s.completed_total,
            ckpt_bytes_used=c.bytes_used,
            ckpt_tokens_held=c.tokens_held,
            durable=[pb.DurableTokens(rid=r, tokens=t) for r, t in ckpt.durable(full=full).items()],
            abandoned_checkpoints=ckpt.abandoned(),
            restored_tokens_total=c.restored_tokens,
            ckpt_bytes_sent_total=c.bytes_sent,
            ckpt_pages_evicted_total=c.pages_evicted,
            restores_total=c.restores,
            draft=pb.DraftStats(drafted_tokens=d.drafted, accepted_tokens=d.accepted, rounds=d.rounds),
        )

    async def _dispatch(self, call: grpc.aio.StreamStreamCall, incarnation: int) -> None:
        while True:
            msg = await self._read(call, incarnation)
            if msg is None:
                return
            self.handle(msg)

    def handle(self, msg: pb.GatewayMessage) -> None:
        """Apply one gateway message of the current incarnation; a Refuse ends the session."""
        kind = msg.WhichOneof("body")
        engine = self.engine
        if kind == "drain":
            log.info("draining", worker_id=engine.worker_id)
            engine.drain()
        elif kind == "drop_checkpoint":
            engine.ckpt.drop(list(msg.drop_checkpoint.rids))
        elif kind == "assign_holder":
            a = msg.assign_holder
            resent = engine.assign_holders(a.rid, [h.kv_endpoint for h in a.holders])
            log.info("holders assigned", rid=a.rid, holders=[h.worker_id for h in a.holders], resent=resent)
        elif kind == "start_draft_assist":
            s = msg.start_draft_assist
            engine.assist.start_pair(s.peer_id, s.peer_endpoint, s.role, s.k)
        elif kind == "stop_draft_assist":
            engine.assist.stop_pair(msg.stop_draft_assist.peer_id)
        elif kind == "refuse":
            self.refusals += 1
            raise SessionEnded(f"refused: {msg.refuse.reason}")
        elif kind == "welcome":
            log.warning("duplicate Welcome ignored", worker_id=engine.worker_id)
        else:
            log.info("unknown command ignored", worker_id=engine.worker_id, command=kind)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return type(exc).__name__
