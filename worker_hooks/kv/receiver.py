"""The holder side of the KV checkpoint plane: a PULL socket feeding a `CheckpointStore`.

`StoreServer` binds at the holder's `kv_endpoint` (tcp://127.0.0.1:0 picks a free port; `endpoint`
reports the bound one; ipc:// works too), receives zero-copy (the store keeps memoryview slices of the
received frames), and applies PAGES/END/DROP to the store. A bad message (another protocol version,
a malformed or inconsistent header) is refused and logged and changes nothing; the loop keeps going.
It owns one task, started by `start()` and ended by `close()`.

Security (`gateway.protocol.planes`; the socket's set-up is `gateway.protocol.plane_server.PlaneServer`,
the drafter's too): with a `PlaneAuth` the socket is a CURVE server whose context's ZAP handler admits
only current members' keys (never the gateway's: it sends no pages), and every message is checked
again before it reaches the store: its connection's key must still be a current member's (else
`unauthenticated`), and the header's `src_worker`/`incarnation` must be that member's worker and
current incarnation (else `impersonated` or `stale_epoch`). `PLAINTEXT` (unit tests only) skips all
of it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import structlog
import zmq
import zmq.asyncio

from gateway.protocol.kv import KvHeader, KvProtocolError, KvType, decode
from gateway.protocol.plane_server import PlaneServer
from gateway.protocol.planes import KV_DOMAIN, Member, PlaneAuth, Security, user_id
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


class StoreServer(PlaneServer):
    noun: ClassVar[str] = "KV store"
    plane: ClassVar[str] = "kv"
    domain: ClassVar[str] = KV_DOMAIN
    socket_type: ClassVar[int] = zmq.PULL
    admits_gateways: ClassVar[bool] = False  # members only, never the gateway: it sends no pages

    stats: ReceiverStats

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
        super().__init__(endpoint, auth=auth, ctx=ctx, refusal_event="kv_message_refused")
        self.store = store
        self._rcvhwm = rcvhwm
        self._on_hold = on_hold
        self._slice_s = slice_s  # longest run of messages handled between two yields to the loop
        self.stats = ReceiverStats()

    def _configure(self, sock: zmq.asyncio.Socket) -> None:
        sock.setsockopt(zmq.RCVHWM, self._rcvhwm)

    def _started(self) -> None:
        log.info(
            "kv_store_listening",
            endpoint=self.endpoint,
            budget_bytes=self.store.budget_bytes,
            curve=isinstance(self.auth, PlaneAuth),
        )

    async def _run(self) -> None:
        sock = self._socket()
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
                    self._refuse_stranger(key)
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
