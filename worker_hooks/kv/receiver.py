"""The holder side of the KV checkpoint plane: a PULL socket feeding a `CheckpointStore`.

`StoreServer` binds at the holder's `kv_endpoint` (tcp://127.0.0.1:0 picks a free port; `endpoint`
reports the bound one; ipc:// works too), receives zero-copy (the store keeps memoryview slices of the
received frames), and applies PAGES/END/DROP to the store. A bad message (another protocol version,
a malformed or inconsistent header) is refused and logged and changes nothing; the loop keeps going.
It owns one task, started by `start()` and ended by `close()`.

Security (`gateway.protocol.planes`): with a `PlaneAuth` the socket is a CURVE server whose context's
ZAP handler admits only current members' keys, and every message is checked again before it reaches
the store: its connection's key must still be a current member's (else `unauthenticated`), and the
header's `src_worker`/`incarnation` must be that member's worker and current incarnation (else
`impersonated` or `stale_epoch`). `PLAINTEXT` (unit tests only) skips all of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

import structlog
import zmq
import zmq.asyncio

from gateway.protocol.kv import KvHeader, KvProtocolError, KvType, decode
from gateway.protocol.planes import KV_DOMAIN, Member, PlaneAuth, RefusalLog, Security, curve_server, user_id
from gateway.protocol.zap import HandshakeWatch, ZapGuard
from worker_hooks.kv.store import CheckpointStore, HoldResult

log = structlog.get_logger("lumen.kv.receiver")


@dataclass(slots=True)
class ReceiverStats:
    messages: int = 0
    refused: int = 0
    pages: int = 0
    payload_bytes: int = 0
    ends: int = 0
    drops: int = 0
    gaps: int = 0
    stale: int = 0
    # refused before the store (CURVE mode): not a current member's connection; a header naming
    # another worker than the connection's key; an incarnation that is not the member's current one
    unauthenticated: int = 0
    impersonated: int = 0
    stale_epoch: int = 0


class StoreServer:
    def __init__(
        self,
        store: CheckpointStore,
        endpoint: str = "tcp://127.0.0.1:0",
        *,
        auth: Security,
        ctx: zmq.asyncio.Context | None = None,
        rcvhwm: int = 64,
        on_hold: Callable[[KvHeader, HoldResult], None] | None = None,
        slice_s: float = 0.002,
    ) -> None:
        self.store = store
        self.auth = auth
        self._bind_to = endpoint
        self._own_ctx = ctx is None
        self._ctx = ctx if ctx is not None else zmq.asyncio.Context()
        self._rcvhwm = rcvhwm
        self._on_hold = on_hold
        self._slice_s = slice_s  # longest run of messages handled between two yields to the loop
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.stats = ReceiverStats()
        self.refusals = RefusalLog("kv_message_refused")
        self._guard: ZapGuard | None = None
        self._handshakes: HandshakeWatch | None = None
        self.endpoint = ""

    async def start(self) -> str:
        if self._sock is not None:
            raise RuntimeError("StoreServer already started")
        sock = self._ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self._rcvhwm)
        auth = self.auth
        if isinstance(auth, PlaneAuth):
            curve_server(sock, auth, KV_DOMAIN)
            # members only, never the gateway: it sends no pages
            self._guard = ZapGuard.acquire(
                self._ctx, KV_DOMAIN, lambda key: auth.members.allows(key, gateways=False)
            )
        try:
            sock.bind(self._bind_to)
        except zmq.ZMQError as exc:
            sock.close(0)
            self._release_guard()
            raise OSError(f"cannot bind KV store at {self._bind_to}: {exc}") from exc
        self._sock = sock
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if isinstance(auth, PlaneAuth):
            self._handshakes = HandshakeWatch(sock, "kv")
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-store {self.endpoint}")
        log.info(
            "kv_store_listening",
            endpoint=self.endpoint,
            budget_bytes=self.store.budget_bytes,
            curve=isinstance(auth, PlaneAuth),
        )
        return self.endpoint

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._handshakes is not None:
            await self._handshakes.close()
            self._handshakes = None
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        self._release_guard()
        if self._own_ctx:
            self._ctx.term()

    @property
    def handshakes_failed(self) -> int:
        """Connections whose CURVE handshake failed (no CURVE, wrong server key, not a member)."""
        return self._handshakes.failed if self._handshakes is not None else 0

    def _release_guard(self) -> None:
        if self._guard is not None:
            self._guard.release(KV_DOMAIN)
            self._guard = None

    async def __aenter__(self) -> StoreServer:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def _run(self) -> None:
        sock = self._sock
        if sock is None:
            raise RuntimeError("StoreServer not started")
        while True:
            try:
                frames = await sock.recv_multipart(copy=False)
            except zmq.Again:
                # pyzmq saw POLLIN but the message was gone by the recv (a pipe of a connection that
                # was just refused or closed): nothing to read, wait again
                continue
            deadline = time.perf_counter() + self._slice_s
            while True:
                self._apply(frames)
                if time.perf_counter() > deadline:
                    break
                try:  # drain what is already queued without going through the loop's poller
                    frames = await sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
            # yield after each slice so a flood cannot starve the rest of the loop
            await asyncio.sleep(0)

    def _apply(self, frames: list[zmq.Frame]) -> None:
        peer: Member | None = None
        auth = self.auth
        try:
            if isinstance(auth, PlaneAuth):
                key = user_id(frames[0])
                peer = auth.members.member(key)
                if peer is None:  # not (or no longer) a member: nothing of it is even decoded
                    self.stats.messages += 1
                    self.stats.refused += 1
                    self.stats.unauthenticated += 1
                    self.refusals("not a current member", key)
                    return
            self.handle([f.buffer for f in frames], peer)
        except Exception:  # the outermost loop: one bad message must not stop the store
            self.stats.refused += 1
            log.exception("kv_message_failed", frames=len(frames))

    def handle(self, frames: list[memoryview], peer: Member | None = None) -> None:
        """Apply one received message to the store; a bad one is refused and logged. `peer`: the
        member the message's connection authenticated as (CURVE mode), whose identity the header
        must carry."""
        self.stats.messages += 1
        try:
            header, payload = decode(frames)
        except KvProtocolError as exc:
            self.stats.refused += 1
            log.warning("kv_message_refused", reason=str(exc), frames=len(frames))
            return
        if peer is not None and not self._is_from(peer, header):
            return
        if header.type is KvType.PAGES:
            self._pages(header, payload)
            return
        if header.type is KvType.END:
            self.stats.ends += 1
        else:
            self.stats.drops += 1
        self.store.release(header.rid, src_worker=header.src_worker, incarnation=header.incarnation)

    def _is_from(self, peer: Member, h: KvHeader) -> bool:
        """Whether `h` is in the name of `peer`'s current incarnation; counts and logs a refusal."""
        if h.src_worker != peer.worker_id:
            self.stats.impersonated += 1
            reason = "src_worker is not the connection's member"
        elif h.incarnation != peer.incarnation:
            self.stats.stale_epoch += 1
            reason = "incarnation is not the member's current one"
        else:
            return True
        self.stats.refused += 1
        self.refusals(
            reason,
            peer.key,
            member=peer.worker_id,
            member_incarnation=peer.incarnation,
            src_worker=h.src_worker[:64],
            incarnation=h.incarnation,
            rid=h.rid[:64],
        )
        return False

    def _pages(self, h: KvHeader, payload: memoryview) -> None:
        n = h.page_bytes
        # zero-copy: each page is a slice of the received frame, kept alive by the store
        pages = [payload[i * n : (i + 1) * n] for i in range(h.n_pages)]
        try:
            result = self.store.hold(
                h.rid,
                src_worker=h.src_worker,
                incarnation=h.incarnation,
                first_page=h.first_page,
                page_size=h.page_size,
                token_ids=h.token_ids,
                pages=pages,
                parent_key=h.parent_key,
            )
        except ValueError as exc:  # e.g. a parent_key that is not hex
            self.stats.refused += 1
            log.warning("kv_message_refused", reason=str(exc), rid=h.rid, src_worker=h.src_worker)
            return
        self.stats.pages += result.accepted
        self.stats.payload_bytes += payload.nbytes
        if result.stale:
            self.stats.stale += 1
            log.info("kv_stale_pages_ignored", rid=h.rid, src_worker=h.src_worker, incarnation=h.incarnation)
        elif result.gap:
            self.stats.gaps += 1
            log.info(
                "kv_pages_gap", rid=h.rid, first_page=h.first_page, held=self.store.durable_tokens(h.rid)
            )
        if result.evicted:
            log.info("kv_evicted", rids=list(result.evicted), for_rid=h.rid)
        if result.refused:
            log.info("kv_pages_refused", rid=h.rid, refused=result.refused, bytes_used=self.store.bytes_used)
        if self._on_hold is not None:
            self._on_hold(h, result)
