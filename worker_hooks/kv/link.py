"""One serving worker's PUSH link to one checkpoint holder: a queue, a socket and the task that
drains one into the other.

Pages are queued per request in arrival order (the dict's insertion order is the FIFO of requests).
The task sends a request's queued pages once they reach `frame_bytes`, once the request ends or is
dropped, or once its oldest queued page has waited `linger_s`; consecutive pages of one request are
grouped into frames of at least `frame_bytes` where the queue holds enough of them. Grouping copies
(in this task, never on the caller's path); a single queued chunk goes out as the caller's buffer.
`queued_bytes` counts what the link holds and is sending; zmq's own queue (SNDHWM messages) is on top.

A link may start without a socket (`connect` returns None while the holder's CURVE server key is not
known yet, e.g. a holder named by a request that arrived before the gateway's Members update): pages
queue as for a holder that is not connected, and the task retries every `KEY_POLL_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import structlog
import zmq
import zmq.asyncio

from gateway.protocol.kv import KvType, control_header, encode_header, pages_header
from gateway.protocol.zap import KEY_POLL_S

log = structlog.get_logger("lumen.kv.link")
Connect = Callable[[str], zmq.asyncio.Socket | None]
# how long a link waits for its holder's key before it says so in the log (it keeps waiting)
KEY_WAIT_LOG_S = 2.0


@dataclass(slots=True, eq=False)
class Chunk:
    """The pages of one `send_pages` call; shared by every holder it goes to, never copied."""

    first_page: int
    n_pages: int
    page_size: int
    page_bytes: int
    token_ids: Sequence[int]
    payload: memoryview
    parent_key: str | None
    dtype: str
    shape: list[int] | None

    @property
    def nbytes(self) -> int:
        return self.n_pages * self.page_bytes

    def continued_by(self, nxt: Chunk) -> bool:
        return (
            nxt.parent_key is None
            and nxt.first_page == self.first_page + self.n_pages
            and (nxt.page_size, nxt.page_bytes, nxt.dtype, nxt.shape)
            == (self.page_size, self.page_bytes, self.dtype, self.shape)
        )


@dataclass(slots=True, eq=False)
class _RidQueue:
    since: float
    chunks: deque[Chunk] = field(default_factory=deque)
    nbytes: int = 0
    closing: KvType | None = None  # END or DROP to send after the pages


def _ids(token_ids: Sequence[int]) -> list[int]:
    # msgspec encodes Python ints, not numpy scalars
    return token_ids.tolist() if isinstance(token_ids, np.ndarray) else list(token_ids)


class _BufferPool:
    """Reusable staging buffers for grouped frames: fresh memory for every frame would cost a page
    fault per 4 KiB. A buffer goes back to the pool once zmq reports it has sent the frame."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._free: list[memoryview] = []
        self._lent: deque[tuple[zmq.MessageTracker, memoryview]] = deque()

    def take(self, size: int) -> memoryview:
        while self._lent and self._lent[0][0].done:
            self._free.append(self._lent.popleft()[1])
        for i, buf in enumerate(self._free):
            if buf.nbytes >= size:
                return self._free.pop(i)
        return memoryview(bytearray(size))

    def lend(self, buf: memoryview, tracker: zmq.MessageTracker) -> None:
        if len(self._free) + len(self._lent) < self._keep:
            self._lent.append((tracker, buf))


@dataclass(slots=True)
class LinkStats:
    frames: int = 0
    pages: int = 0
    bytes: int = 0
    controls: int = 0


class HolderLink:
    def __init__(
        self,
        endpoint: str,
        sock: zmq.asyncio.Socket | None,
        *,
        connect: Connect | None = None,
        src_worker: str,
        incarnation: int,
        frame_bytes: int,
        linger_s: float,
        sndhwm: int,
        clock: Callable[[], float],
    ) -> None:
        self.endpoint = endpoint
        self._sock = sock
        self._connect = connect  # makes the socket once it can (sock None)
        self._src, self._inc = src_worker, incarnation
        self._frame_bytes, self._linger_s, self._clock = frame_bytes, linger_s, clock
        self.pending: dict[str, _RidQueue] = {}
        self.rids: set[str] = set()  # requests with pages sent or queued here
        self.abandoned: set[str] = set()
        self.queued_bytes = 0
        self.stats = LinkStats()
        # zmq holds up to SNDHWM sent frames; a few more cover the one being filled
        self._buffers = _BufferPool(keep=sndhwm + 4)
        self._wake = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-link {endpoint}")

    # -- caller side: O(1) per call apart from dropping a request's queue -------------------------
    def enqueue(self, rid: str, chunk: Chunk) -> None:
        rq = self.pending.get(rid)
        if rq is None:
            rq = self.pending[rid] = _RidQueue(self._clock())
        rq.chunks.append(chunk)
        rq.nbytes += chunk.nbytes
        self.queued_bytes += chunk.nbytes
        self.rids.add(rid)
        self._wake.set()

    def close_rid(self, rid: str, kind: KvType) -> int:
        """Queue END or DROP for `rid` (DROP discards its queued pages); returns bytes discarded."""
        self.rids.discard(rid)
        if rid in self.abandoned:
            self.abandoned.discard(rid)  # its DROP is already queued or sent
            return 0
        rq = self.pending.get(rid)
        discarded = 0
        if rq is None:
            rq = self.pending[rid] = _RidQueue(self._clock())
        elif kind is KvType.DROP:
            discarded = rq.nbytes
            self.queued_bytes -= discarded
            rq.chunks.clear()
            rq.nbytes = 0
        rq.closing = kind
        self._wake.set()
        return discarded

    def abandon(self, rid: str) -> int:
        """Give up `rid`'s checkpoint on this holder: drop its queued pages, queue a DROP."""
        discarded = self.close_rid(rid, KvType.DROP)
        self.abandoned.add(rid)
        return discarded

    # -- the task -------------------------------------------------------------------------------
    async def _connected(self) -> zmq.asyncio.Socket:
        sock = self._sock
        if sock is not None:
            return sock
        if self._connect is None:
            raise RuntimeError("a HolderLink without a socket needs `connect`")
        waited = 0.0
        while True:
            try:
                sock = self._connect(self.endpoint)
            except ValueError as exc:  # an endpoint zmq will not connect to
                log.error("kv_link_cannot_connect", endpoint=self.endpoint, error=str(exc))
                await asyncio.Event().wait()  # pages stay queued (lag, then abandoned) until stopped
            if sock is not None:
                self._sock = sock
                return sock
            await asyncio.sleep(KEY_POLL_S)
            waited += KEY_POLL_S
            if waited >= KEY_WAIT_LOG_S and waited - KEY_POLL_S < KEY_WAIT_LOG_S:
                log.warning("kv_link_waiting_for_holder_key", endpoint=self.endpoint, waited_s=waited)

    async def _run(self) -> None:
        await self._connected()
        while True:
            if not self.pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            now = self._clock()
            deadline: float | None = None
            sent = False
            for rid in list(self.pending):
                rq = self.pending[rid]
                if rq.closing is None and rq.nbytes < self._frame_bytes and now - rq.since < self._linger_s:
                    due = rq.since + self._linger_s
                    deadline = due if deadline is None else min(deadline, due)
                    continue
                # pages queued for rid while this flush awaits go to a new queue, sent after it
                del self.pending[rid]
                await self._flush(rid, rq)
                sent = True
            if not sent and deadline is not None:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), max(0.0, deadline - now))

    async def _flush(self, rid: str, rq: _RidQueue) -> None:
        sock = self._sock
        assert sock is not None  # _run connects first
        chunks = rq.chunks
        while chunks:
            group = [chunks.popleft()]
            size = group[0].nbytes
            while chunks and size < self._frame_bytes and group[-1].continued_by(chunks[0]):
                group.append(chunks.popleft())
                size += group[-1].nbytes
            head = group[0]
            ids = list(itertools.chain.from_iterable(_ids(c.token_ids) for c in group))
            header = pages_header(
                rid=rid,
                src_worker=self._src,
                incarnation=self._inc,
                first_page=head.first_page,
                page_size=head.page_size,
                token_ids=ids,
                page_bytes=head.page_bytes,
                parent_key=head.parent_key,
                dtype=head.dtype,
                shape=head.shape,
            )
            try:
                if len(group) == 1:  # the caller's buffer, as is
                    await sock.send_multipart([encode_header(header), head.payload], copy=False)
                else:
                    buf = self._buffers.take(size)
                    offset = 0
                    for c in group:
                        buf[offset : offset + c.nbytes] = c.payload
                        offset += c.nbytes
                    frames = [encode_header(header), buf[:size]]
                    tracker = await sock.send_multipart(frames, copy=False, track=True)
                    if tracker is not None:
                        self._buffers.lend(buf, tracker)
            finally:
                self.queued_bytes -= size
            self.stats.frames += 1
            self.stats.pages += sum(c.n_pages for c in group)
            self.stats.bytes += size
        if rq.closing is not None:
            header = control_header(rq.closing, rid=rid, src_worker=self._src, incarnation=self._inc)
            await sock.send_multipart([encode_header(header), b""], copy=False)
            self.stats.controls += 1

    async def stop(self, linger_ms: int = 0) -> None:
        """End the task and close the socket; zmq keeps delivering its queue for `linger_ms`."""
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        if self._sock is not None:
            self._sock.close(linger_ms)

    @property
    def idle(self) -> bool:
        return not self.pending and self.queued_bytes == 0
