"""The serving side of the KV checkpoint plane (DESIGN 4.4): stream full pages to holders.

`send_pages` is called from the decode loop and never blocks it: it validates sizes, wraps the payload
in a memoryview (no copy) and appends it to each holder's queue; one task per holder (`HolderLink`)
groups and sends. The payload buffer must stay unmodified until sent (pass `bytes`, or a view of
memory that is not reused). When a holder's queued bytes exceed `max_lag_bytes`, the request whose
pages overflow it is abandoned on that holder: its queued pages are dropped, a DROP is queued, and
`abandoned()` reports it so the heartbeat can tell the gateway. Call from the event loop's thread.

With a `PlaneAuth` every link is a CURVE client that presents this process's key and pins the holder's
server key (`server_key(endpoint)`, by default the member table's): pages go only to a member, and
only as this member. A holder whose key is not known yet gets a link that waits for it (link.py).
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType

import numpy as np
import zmq
import zmq.asyncio

from gateway.protocol.kv import KvType
from gateway.protocol.planes import PlaneAuth, Security, curve_client
from gateway.protocol.zap import RetryRefused
from worker_hooks.kv.link import Chunk, HolderLink, LinkStats


@dataclass(frozen=True, slots=True)
class Abandoned:
    rid: str
    endpoint: str
    dropped_bytes: int


@dataclass(frozen=True, slots=True)
class CallerCost:
    """Time spent inside `send_pages` by its caller, over the last `calls` calls."""

    calls: int
    p50_us: float
    p99_us: float
    max_us: float


class CheckpointSender:
    def __init__(
        self,
        src_worker: str,
        incarnation: int,
        *,
        auth: Security,
        server_key: Callable[[str], str | None] | None = None,
        ctx: zmq.asyncio.Context | None = None,
        frame_bytes: int = 1 << 20,
        linger_s: float = 0.002,
        max_lag_bytes: int = 256 << 20,
        sndhwm: int = 16,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if frame_bytes < 1 or max_lag_bytes < 1 or linger_s < 0 or sndhwm < 1:
            raise ValueError("frame_bytes, max_lag_bytes and sndhwm must be >= 1 and linger_s >= 0")
        self.src_worker, self.incarnation = src_worker, incarnation
        self.auth = auth
        # a holder endpoint's CURVE server key (None: not known yet)
        self._server_key = server_key or (auth.members.server_key if isinstance(auth, PlaneAuth) else None)
        self.frame_bytes, self.linger_s, self.max_lag_bytes = frame_bytes, linger_s, max_lag_bytes
        self._own_ctx = ctx is None
        self._ctx = ctx if ctx is not None else zmq.asyncio.Context()
        self._sndhwm = sndhwm
        self._clock = clock
        self._links: dict[str, HolderLink] = {}
        self._retries: list[RetryRefused] = []  # CURVE: reconnect after a refused handshake
        self._abandoned: list[Abandoned] = []
        self._cost_ns: deque[int] = deque(maxlen=1 << 16)
        self._closed = False

    # -- the decode loop's API ------------------------------------------------------------------
    def send_pages(
        self,
        rid: str,
        holder_endpoints: Sequence[str],
        first_page: int,
        token_ids: Sequence[int],
        payload: bytes | bytearray | memoryview,
        *,
        page_size: int,
        parent_key: str | None = None,
        dtype: str = "uint8",
        shape: list[int] | None = None,
    ) -> None:
        """Queue full pages first_page.. of `rid` (their token ids and bytes) for every holder.

        `parent_key` is needed only when a request's first pages sent here start mid-chain (e.g. after
        a restore): the key of page first_page-1 (see `gateway.protocol.kv`).
        """
        t0 = time.perf_counter_ns()
        if self._closed:
            raise RuntimeError("CheckpointSender is closed")
        n_tokens = len(token_ids)
        if page_size < 1 or n_tokens == 0 or n_tokens % page_size or first_page < 0:
            raise ValueError(f"need whole pages: {n_tokens} token ids, page_size {page_size}")
        n_pages = n_tokens // page_size
        view = payload if isinstance(payload, memoryview) else memoryview(payload)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")  # a flat byte view of the same memory (e.g. of a numpy array)
        if view.nbytes == 0 or view.nbytes % n_pages:
            raise ValueError(f"payload of {view.nbytes} B does not split into {n_pages} pages")
        chunk = Chunk(
            first_page, n_pages, page_size, view.nbytes // n_pages, token_ids, view, parent_key, dtype, shape
        )
        for endpoint in holder_endpoints:
            link = self._links.get(endpoint) or self._open(endpoint)
            if rid in link.abandoned:
                continue  # given up on this holder until end()/drop()
            link.enqueue(rid, chunk)
            if link.queued_bytes > self.max_lag_bytes:
                self._abandoned.append(Abandoned(rid, endpoint, link.abandon(rid)))
        self._cost_ns.append(time.perf_counter_ns() - t0)

    def end(self, rid: str) -> None:
        """The request finished: flush its queued pages, then END (the holder frees them)."""
        self._close_rid(rid, KvType.END)

    def drop(self, rid: str) -> None:
        """Cancel the request's checkpoint: discard its queued pages and DROP it at every holder."""
        self._close_rid(rid, KvType.DROP)

    def _close_rid(self, rid: str, kind: KvType) -> None:
        for link in self._links.values():
            if rid in link.rids or rid in link.abandoned:
                link.close_rid(rid, kind)

    def abandoned(self) -> list[Abandoned]:
        """Drain the (request, holder) checkpoints abandoned since the last call."""
        out, self._abandoned = self._abandoned, []
        return out

    # -- observation ----------------------------------------------------------------------------
    def queued_bytes(self, endpoint: str) -> int:
        link = self._links.get(endpoint)
        return link.queued_bytes if link else 0

    def stats(self) -> dict[str, LinkStats]:
        """Per holder endpoint: frames, pages, bytes and control messages sent so far."""
        return {e: copy.copy(link.stats) for e, link in self._links.items()}

    def caller_cost(self) -> CallerCost:
        if not self._cost_ns:
            return CallerCost(0, 0.0, 0.0, 0.0)
        us = np.fromiter(self._cost_ns, dtype=np.float64, count=len(self._cost_ns)) / 1e3
        p50, p99 = np.percentile(us, [50, 99])
        return CallerCost(len(us), float(p50), float(p99), float(us.max()))

    def reset_caller_cost(self) -> None:
        self._cost_ns.clear()

    # -- lifecycle ------------------------------------------------------------------------------
    def _socket(self, endpoint: str) -> zmq.asyncio.Socket | None:
        """A PUSH connected to `endpoint`; None while its holder's server key is not known (CURVE).
        ValueError for an endpoint zmq will not connect to."""
        if self._closed:
            return None
        server_key = None
        auth = self.auth
        if isinstance(auth, PlaneAuth):
            assert self._server_key is not None
            server_key = self._server_key(endpoint)
            if server_key is None:
                return None
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, self._sndhwm)
        sock.setsockopt(zmq.LINGER, 0)
        # queue only to a connected holder, so a missing holder shows up as lag, not a black hole
        sock.setsockopt(zmq.IMMEDIATE, 1)
        try:
            if isinstance(auth, PlaneAuth) and server_key is not None:
                curve_client(sock, auth.keys, server_key)
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise ValueError(f"bad holder endpoint {endpoint!r}: {exc}") from exc
        if isinstance(auth, PlaneAuth):
            self._retries.append(RetryRefused(sock, endpoint))
        return sock

    def _open(self, endpoint: str) -> HolderLink:
        sock = self._socket(endpoint)
        link = HolderLink(
            endpoint,
            sock,
            connect=self._socket,
            src_worker=self.src_worker,
            incarnation=self.incarnation,
            frame_bytes=self.frame_bytes,
            linger_s=self.linger_s,
            sndhwm=self._sndhwm,
            clock=self._clock,
        )
        self._links[endpoint] = link
        return link

    async def flush(self, timeout_s: float) -> bool:
        """Wait until every queue has been handed to zmq, up to `timeout_s`; True when it was."""
        deadline = self._clock() + timeout_s
        while not all(link.idle for link in self._links.values()):
            if self._clock() >= deadline:
                return False
            await asyncio.sleep(0.001)
        return True

    async def close(self, drain_timeout_s: float = 0.0) -> None:
        """Stop. With a drain timeout, first wait for the queues to reach zmq and give zmq that long
        to deliver (terminating an owned context then blocks up to it); else discard what is queued."""
        if self._closed:
            return
        self._closed = True
        if drain_timeout_s > 0:
            await self.flush(drain_timeout_s)
        for retry in self._retries:
            await retry.close()
        self._retries.clear()
        for link in self._links.values():
            await link.stop(linger_ms=int(drain_timeout_s * 1000))
        self._links.clear()
        if self._own_ctx:
            self._ctx.term()

    async def __aenter__(self) -> CheckpointSender:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
