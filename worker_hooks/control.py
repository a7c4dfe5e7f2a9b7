"""One control-plane client for every kind of worker: attach, heartbeat, obey, re-attach (DESIGN 4.3).

`ControlClient` holds what is the same for Lumen's engine (worker_hooks/agent.py) and the SGLang
sidecar (worker_hooks/sglang/agent.py); an `AgentRole` supplies what differs: the Hello's fields, each
heartbeat's content, the commands, and what to do when the gateway stops trusting an incarnation.

One session = one `Attach` stream: Hello -> Welcome (or Refuse) -> a Heartbeat every interval, while
gateway messages are read and dispatched. Heartbeats are scheduled by absolute deadlines, so a busy
event loop delays one beat but never shifts the whole train.

When the gateway refuses this incarnation (at Hello: it failed it already, e.g. after a network
break) or fences it mid-session (a `Refuse` before it ends the stream: it declared the worker failed),
it no longer trusts our in-flight requests: the role resets its incarnation and the client re-attaches
with exponential backoff. So does a session the role ends itself (`end_session`: its server died). A
stream that merely ends or breaks (the gateway restarting, or killed) resets nothing: the same
incarnation attaches again, its requests running on, kept for adoption by the gateway their clients
resume on, and the other gateways of the cluster keep theirs. Gateway messages for another
incarnation are dropped.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import grpc
import structlog

from gateway.protocol import control_pb2 as pb
from gateway.protocol.control_pb2_grpc import ControlStub
from gateway.protocol.versions import CONTROL_PROTOCOL_VERSION

log = structlog.get_logger(__name__)

BACKOFF_START_S = 0.05
BACKOFF_CAP_S = 1.0
WELCOME_TIMEOUT_S = 5.0
# a heartbeat that could not be written (the gateway finished the call) waits this long for the read
# side to deliver what the gateway said last: a fenced stream's Refuse is written just before its end
LAST_WORD_TIMEOUT_S = 1.0


class SessionEnded(Exception):
    """The gateway closed the stream or refused us, or the role ended it; carries why, for the log."""


class AgentRole(Protocol):
    """What one kind of worker tells the gateway and does on its orders."""

    @property
    def worker_id(self) -> str: ...

    @property
    def incarnation(self) -> int: ...

    def hello(self) -> pb.Hello:
        """This worker's description now; the client fills protocol version, incarnation and token."""
        ...

    def heartbeat(self, seq: int, *, full: bool) -> pb.Heartbeat:
        """The worker's state now; `full`: the session's first beat (report all, not only changes)."""
        ...

    def command(self, msg: pb.GatewayMessage) -> None:
        """Apply one command of the current incarnation (anything but Welcome and Refuse)."""
        ...

    def welcomed(self, welcome: pb.Welcome) -> None:
        """The gateway accepted this incarnation; what its Welcome says beyond the session's terms."""
        ...

    async def reset(self) -> None:
        """The gateway knew this incarnation and the session ended: void what it had in flight here and
        become a new, strictly newer incarnation before the next Hello."""
        ...


class ControlClient:
    def __init__(
        self,
        role: AgentRole,
        address: str,
        *,
        token: str = "",
        tls_ca: str = "",
        heartbeat_interval_ms: int = 50,
        backoff_start_s: float = BACKOFF_START_S,
        backoff_cap_s: float = BACKOFF_CAP_S,
        welcome_timeout_s: float = WELCOME_TIMEOUT_S,
    ) -> None:
        self.role = role
        self.address = address
        self.token = token
        self.tls_ca = tls_ca  # PEM file the gateway's control-plane certificate must chain to; "": plaintext
        self.default_heartbeat_ms = heartbeat_interval_ms  # when the Welcome names none
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
        self._refused = False  # whether the gateway refused or fenced the current incarnation
        self._end: asyncio.Event | None = None  # the live session's "end it now" signal
        self._end_reason = ""

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("agent already started")
        self._task = asyncio.create_task(self._run(), name=f"agent-{self.role.worker_id}-{self.address}")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            # again until it ends: a library call may swallow one cancellation
            while not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=1.0)
            if not task.cancelled() and task.exception() is not None:
                log.error(
                    "agent ended with an error", worker_id=self.role.worker_id, error=repr(task.exception())
                )
        self.attached.clear()

    def end_session(self, reason: str, *, reset: bool = True) -> bool:
        """End the live session now (the call is cancelled, so the gateway fails this incarnation at
        once); the client then resets (unless `reset` is False: the role has a new incarnation
        already) and re-attaches as usual. False when no session is live."""
        end = self._end
        if end is None or end.is_set():
            return False
        self._end_reason = reason
        self._refused = reset  # a new incarnation follows
        end.set()
        return True

    def _channel(self) -> grpc.aio.Channel:
        if not self.tls_ca:
            return grpc.aio.insecure_channel(self.address)
        with open(self.tls_ca, "rb") as f:
            creds = grpc.ssl_channel_credentials(root_certificates=f.read())
        return grpc.aio.secure_channel(self.address, creds)

    # -- the reconnect loop ---------------------------------------------------------------------
    async def _run(self) -> None:
        backoff = self.backoff_start_s
        wid = self.role.worker_id
        while True:
            self._answered = False
            self._refused = False
            try:
                await self._session()
            except SessionEnded as exc:
                log.warning("control session ended", worker_id=wid, address=self.address, reason=str(exc))
            except (grpc.RpcError, TimeoutError, asyncio.InvalidStateError) as exc:
                # while the gateway stays unreachable, only the first failure is worth an info line
                (log.info if backoff == self.backoff_start_s else log.debug)(
                    "control stream failed", worker_id=wid, address=self.address, error=_describe(exc)
                )
            except Exception:
                # the outermost loop of the agent: log, and treat it like a broken stream
                log.exception("control session crashed", worker_id=wid, address=self.address)
            self.attached.clear()
            self._end = None
            if self._refused:
                # the gateway refused or fenced this incarnation: whatever it had in flight here is
                # void; come back as a new one. A stream that only ended (the gateway restarted or
                # died) changes nothing here: its requests stay adoptable, other gateways keep theirs
                await self.role.reset()
                backoff = self.backoff_start_s
            elif self._answered:
                backoff = self.backoff_start_s
            await asyncio.sleep(backoff)
            backoff = min(self.backoff_cap_s, backoff * 2)

    async def _session(self) -> None:
        """Run one Attach stream until it ends; always ends by raising."""
        end = self._end = asyncio.Event()
        async with self._channel() as channel:
            call = ControlStub(channel).Attach()  # type: ignore[no-untyped-call]  # generated stub
            incarnation = self.role.incarnation
            tasks: list[asyncio.Task[None]] = []
            try:
                await call.write(pb.WorkerMessage(hello=self._hello(incarnation)))
                self.sessions += 1
                # asyncio.timeout, not wait_for: 3.11's wait_for loses a cancellation (stop()) that
                # arrives as the Welcome does, and the agent would then never stop
                async with asyncio.timeout(self.welcome_timeout_s):
                    first = await self._read(call, incarnation)
                if first is None:
                    raise SessionEnded("stream closed before Welcome")
                self._answered = True
                if first.WhichOneof("body") == "refuse":
                    self.refusals += 1
                    self._refused = True
                    raise SessionEnded(f"refused: {first.refuse.reason}")
                if first.WhichOneof("body") != "welcome":
                    raise SessionEnded(f"expected Welcome, got {first.WhichOneof('body')}")
                welcome = first.welcome
                if welcome.protocol_version != CONTROL_PROTOCOL_VERSION:
                    self._refused = True  # it recorded this incarnation; a later Hello starts afresh
                    raise SessionEnded(
                        f"gateway speaks control protocol {welcome.protocol_version}, "
                        f"this worker {CONTROL_PROTOCOL_VERSION}"
                    )
                self.gateway_id = welcome.gateway_id
                self.role.welcomed(welcome)
                interval_ms = welcome.heartbeat_interval_ms or self.default_heartbeat_ms
                log.info(
                    "attached",
                    worker_id=self.role.worker_id,
                    gateway=welcome.gateway_id,
                    address=self.address,
                    incarnation=incarnation,
                    heartbeat_ms=interval_ms,
                )
                self.attached.set()
                tasks = [
                    asyncio.create_task(self._heartbeats(call, interval_ms / 1000.0, end)),
                    asyncio.create_task(self._dispatch(call, incarnation)),
                    asyncio.create_task(self._ended(end)),
                ]
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                beats, dispatch, ended = tasks
                if beats in done and dispatch not in done and ended not in done:
                    await asyncio.wait({dispatch}, timeout=LAST_WORD_TIMEOUT_S)
                # the gateway's last word (a Refuse) first: it decides whether this incarnation resets
                for t in sorted(done | {t for t in tasks if t.done()}, key=lambda t: t is not dispatch):
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
        hello = self.role.hello()
        hello.protocol_version = CONTROL_PROTOCOL_VERSION
        hello.incarnation = incarnation
        hello.auth_token = self.token
        return hello

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
                worker_id=self.role.worker_id,
                body=msg.WhichOneof("body"),
                for_incarnation=msg.incarnation,
                ours=incarnation,
            )

    async def _ended(self, end: asyncio.Event) -> None:
        await end.wait()
        raise SessionEnded(f"ended by the worker: {self._end_reason}")

    async def _heartbeats(
        self, call: grpc.aio.StreamStreamCall, interval_s: float, end: asyncio.Event
    ) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        seq = 0
        while True:
            delay = deadline - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            if end.is_set():  # the session is being ended: its last word was the beat before
                raise SessionEnded(f"ended by the worker: {self._end_reason}")
            seq += 1
            await call.write(pb.WorkerMessage(heartbeat=self.heartbeat(seq, full=seq == 1)))
            self.heartbeats_sent += 1
            deadline += interval_s
            now = loop.time()
            if deadline < now - interval_s:
                # more than a whole interval behind (a stalled loop): skip the missed beats
                deadline = now

    def heartbeat(self, seq: int, *, full: bool = False) -> pb.Heartbeat:
        beat = self.role.heartbeat(seq, full=full)
        beat.seq = seq
        return beat

    async def _dispatch(self, call: grpc.aio.StreamStreamCall, incarnation: int) -> None:
        while True:
            msg = await self._read(call, incarnation)
            if msg is None:
                return
            self.handle(msg)

    def handle(self, msg: pb.GatewayMessage) -> None:
        """Apply one gateway message of the current incarnation; a Refuse ends the session."""
        kind = msg.WhichOneof("body")
        if kind == "refuse":  # fenced: the gateway declared this incarnation failed
            self.refusals += 1
            self._refused = True
            raise SessionEnded(f"refused: {msg.refuse.reason}")
        if kind == "welcome":
            log.warning("duplicate Welcome ignored", worker_id=self.role.worker_id)
            return
        self.role.command(msg)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return type(exc).__name__
