"""The gRPC control plane (DESIGN 4.3): workers attach, say Hello, and heartbeat; the gateway fences.

One bidirectional `Attach` stream per worker incarnation. The stream ending (worker crash, network
break) fails the incarnation at once; the monitor ending it (failure detected by silence) tells a
zombie that it is no longer trusted, so it resets and re-attaches as a new incarnation.
"""

from __future__ import annotations

import asyncio
import hmac
import uuid
from collections.abc import Callable

import grpc
import structlog
from grpc import aio

from gateway.core.health import ALIVE_STATES
from gateway.protocol import control_pb2 as pb
from gateway.protocol import control_pb2_grpc as pb_grpc
from gateway.protocol.planes import CurveKeypair, Member, is_key, members_message
from gateway.protocol.versions import CONTROL_PROTOCOL_VERSION
from gateway.server.logbound import LogThrottle, clip
from gateway.server.workers.monitor import AttachRefused, LoadMonitor, WorkerRecord

log = structlog.get_logger("lumen.control")

FENCE_NOTICE_TIMEOUT_S = 0.5  # a fenced worker may be hung: do not wait on its stream for long
# refused Hellos logged: a burst of this many, then this many a second (the others counted)
REFUSAL_LOG_BURST = 10
REFUSAL_LOGS_PER_S = 1.0
MAX_REASON_CHARS = 512  # a refusal's reason, in the log and in the Refuse sent back


class ControlService(pb_grpc.ControlServicer):
    def __init__(self, monitor: LoadMonitor, *, token: str, heartbeat_interval_ms: int) -> None:
        self.monitor = monitor
        self.token = token
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.gateway_id = uuid.uuid4().hex[:12]
        self.outboxes: dict[str, asyncio.Queue[pb.GatewayMessage | None]] = {}
        # called after the monitor has taken each heartbeat, and once a worker is welcomed and `send`
        # reaches it: the recovery coordinator listens (recovery/coordinator.py), nothing else
        self.heartbeat_hooks: list[Callable[[WorkerRecord, pb.Heartbeat], None]] = []
        self.attach_hooks: list[Callable[[WorkerRecord, pb.Hello], None]] = []
        # the data planes (gateway/protocol/planes.py): the gateway's own CURVE keys (it is a draft-plane
        # client for SGLang targets), and the Members list every worker gets whenever it changes
        self.plane_keys = CurveKeypair.generate()
        # whether a restart that is loading its draft model first should go on (Welcome.skip_draft
        # when not); None: the gateway leaves the choice to the worker
        self.draft_first: Callable[[str], bool] | None = None
        self.members_seq = 0
        # refusals of unauthenticated Hellos: a few lines a second, the rest counted (logbound.py)
        self._refusal_log = LogThrottle(per_s=REFUSAL_LOGS_PER_S, burst=REFUSAL_LOG_BURST)

    def send(self, worker_id: str, msg: pb.GatewayMessage) -> bool:
        """Queue a command for a worker's current incarnation; False if it is not attached."""
        rec = self.monitor.workers.get(worker_id)
        box = self.outboxes.get(worker_id)
        if rec is None or box is None:
            return False
        msg.incarnation = rec.incarnation
        box.put_nowait(msg)
        return True

    async def Attach(self, request_iterator: object, context: aio.ServicerContext) -> None:
        first = await context.read()
        if first is aio.EOF or not first.HasField("hello"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "first message must be Hello")
            return
        hello = first.hello
        refusal = self._check_hello(hello)
        if refusal is None and not is_key(hello.plane_key):
            refusal = "Hello needs plane_key: the worker's CURVE public key (Z85, 40 characters)"
        if refusal is None:
            try:
                rec = self.monitor.attach(hello)
            except AttachRefused as exc:
                refusal = str(exc)
            else:
                rec.plane_key = hello.plane_key
                self.broadcast_members()  # the others learn its key before anyone sends it work
        if refusal is not None:
            # the peer is not authenticated: its fields are clipped, the lines rate-limited (logbound.py)
            refusal = str(clip(refusal, MAX_REASON_CHARS))
            suppressed = self._refusal_log.allow()
            if suppressed is not None:
                log.warning(
                    "attach_refused",
                    worker=clip(hello.worker_id),
                    incarnation=hello.incarnation,
                    reason=refusal,
                    suppressed_before=suppressed,
                )
            await context.write(
                pb.GatewayMessage(incarnation=hello.incarnation, refuse=pb.Refuse(reason=refusal))
            )
            return
        await context.write(
            pb.GatewayMessage(
                incarnation=rec.incarnation,
                welcome=pb.Welcome(
                    protocol_version=CONTROL_PROTOCOL_VERSION,
                    gateway_id=self.gateway_id,
                    heartbeat_interval_ms=self.heartbeat_interval_ms,
                    skip_draft=hello.phase == pb.LOADING_DRAFT
                    and self.draft_first is not None
                    and not self.draft_first(rec.id),
                ),
            )
        )
        outbox: asyncio.Queue[pb.GatewayMessage | None] = asyncio.Queue()
        self.outboxes[rec.id] = outbox
        self.send(rec.id, self.members_message())  # its first command: who its peers are
        for hook in self.attach_hooks:
            try:
                hook(rec, hello)
            except Exception:  # a listener's bug must not break the control plane
                log.exception("attach_hook_failed", worker=rec.id, hook=repr(hook))
        reader = asyncio.create_task(self._read_loop(context, rec), name=f"control-read-{rec.id}")
        writer = asyncio.create_task(self._write_loop(context, outbox), name=f"control-write-{rec.id}")
        fenced = asyncio.create_task(rec.fence.wait(), name=f"control-fence-{rec.id}")
        try:
            done, _ = await asyncio.wait({reader, writer, fenced}, return_when=asyncio.FIRST_COMPLETED)
            reason = "fenced by the gateway" if fenced in done else "control stream ended"
            if reader in done and reader.exception() is not None:
                reason = f"control stream broke: {reader.exception()!r}"
            if fenced in done and not writer.done():
                # say so before the stream ends: a fenced worker drops what it ran for us and comes
                # back as a new incarnation, while a stream that merely ends (this gateway restarting)
                # does not make it reset (its requests stay adoptable, other gateways keep theirs).
                # The notice goes through the writer: a gRPC stream takes one write at a time, and a
                # write cancelled in flight leaves its operation pending, failing any later one.
                while not outbox.empty():  # commands not yet sent are void for a fenced incarnation
                    outbox.get_nowait()
                notice = pb.Refuse(
                    reason=f"fenced: incarnation {rec.incarnation} was declared {rec.state.value}"
                )
                outbox.put_nowait(pb.GatewayMessage(incarnation=rec.incarnation, refuse=notice))
                outbox.put_nowait(None)  # then the writer ends
                await asyncio.wait({writer}, timeout=FENCE_NOTICE_TIMEOUT_S)  # it may be hung
        finally:
            for t in (reader, writer, fenced):
                t.cancel()
            await asyncio.gather(reader, writer, fenced, return_exceptions=True)
            if self.outboxes.get(rec.id) is outbox:
                del self.outboxes[rec.id]
            self.monitor.detach(rec, "control stream ended")
        log.info("detached", worker=rec.id, incarnation=rec.incarnation, reason=reason)

    # -- plane membership -------------------------------------------------------------------------
    def members_message(self) -> pb.GatewayMessage:
        """Every live incarnation with a plane key, and the gateway's own key (next `seq`)."""
        self.members_seq += 1
        members = [
            Member(r.id, r.incarnation, r.plane_key, r.kv_endpoint, r.draft_endpoint)
            for r in self.monitor.workers.values()
            if r.plane_key and r.state in ALIVE_STATES
        ]
        return members_message(members, [self.plane_keys.public], self.members_seq)

    def broadcast_members(self) -> None:
        """Send the current Members to every attached worker."""
        if not self.outboxes:
            return
        msg = self.members_message()
        for wid in list(self.outboxes):
            copy = pb.GatewayMessage()
            copy.CopyFrom(msg)
            self.send(wid, copy)

    def _check_hello(self, hello: pb.Hello) -> str | None:
        if hello.protocol_version != CONTROL_PROTOCOL_VERSION:
            return f"protocol version {hello.protocol_version} not supported (gateway speaks {CONTROL_PROTOCOL_VERSION})"
        if self.token and not hmac.compare_digest(hello.auth_token.encode(), self.token.encode()):
            return "bad control token"
        if not hello.worker_id or not hello.http_url:
            return "Hello needs worker_id and http_url"
        return None

    async def _read_loop(self, context: aio.ServicerContext, rec: WorkerRecord) -> None:
        while True:
            msg = await context.read()
            if msg is aio.EOF:
                return
            if msg.HasField("heartbeat"):
                self.monitor.heartbeat(rec, msg.heartbeat)
                if self.monitor.workers.get(rec.id) is rec:
                    for hook in self.heartbeat_hooks:
                        hook(rec, msg.heartbeat)
            else:
                log.warning("unexpected_worker_message", worker=rec.id, kind=msg.WhichOneof("body"))

    async def _write_loop(
        self, context: aio.ServicerContext, outbox: asyncio.Queue[pb.GatewayMessage | None]
    ) -> None:
        while (msg := await outbox.get()) is not None:
            await context.write(msg)


async def start_control_server(
    service: ControlService, host: str, port: int, *, tls: tuple[bytes, bytes] | None = None
) -> tuple[aio.Server, int]:
    """Start the gRPC server; returns it and the bound port (port 0 lets the OS choose). With `tls`
    (private key, certificate chain: PEM) the port speaks TLS only."""
    server = aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_ControlServicer_to_server(service, server)  # type: ignore[no-untyped-call]
    if tls is not None:
        creds = grpc.ssl_server_credentials([tls])
        bound = server.add_secure_port(f"{host}:{port}", creds)
    else:
        bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the control plane on {host}:{port}")
    await server.start()
    return server, bound
