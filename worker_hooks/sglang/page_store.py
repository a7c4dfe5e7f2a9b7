"""HiCache storage semantics over Lumen's KV checkpoint plane, without SGLang (DESIGN 4.4).

SGLang's HiCache calls a storage backend with page keys (its page hash, equal to
`gateway.protocol.pagekeys`) and page bytes, from its own threads (backup, prefetch). `PageStore`
answers those calls with Lumen's machinery; `hicache_backend.LumenHiCacheStorage` is the thin SGLang
subclass that converts tensors and host-pool pages to bytes and calls it. Nothing here imports sglang
or torch, so the default test run exercises all of it.

Writing (`set`, `batch_set`): a page goes to the checkpoint holders of the request it belongs to, over
the KV plane (`CheckpointSender`: ZMQ PUSH, grouped frames, a lag bound per holder). SGLang's storage
calls carry no request id and no token ids, so a *route lookup* says where a page goes: a callable
`key -> [PageRoute]` (one route per live request whose sequence contains the page; none: the page is
not checkpointed). `RequestRoutes` is the table that fills it: the SGLang plugin (or the agent) calls
`admit(rid, token_ids, holders)` when a request arrives with the gateway's `kv_hints`, `extend` as its
tokens grow, `set_holders` when the gateway re-homes it, `retire` when it ends. The table hashes the
request's pages itself, so a route carries the page's token ids and position: the holder recomputes
every key from token ids as for Lumen's own engines (keys are never trusted from the wire), and a
page SGLang hashed from other tokens (another `--page-size`, another namespace) finds no route.

Reading (`exists`, `batch_exists`, `get`, `batch_get`): answered from the *local* holder store, a
`CheckpointStore` behind a `StoreServer` in this process, bound at `holder_bind`: the pages other
workers checkpointed here. So a server that restores a request read the pages its own co-located
holder store was sent, and a read never touches the network.

TP separation by partition: page keys carry no rank, and every TP rank writes its own shard of a page
under the same key. Each rank runs its own page store with its own holder store at its own endpoint
(`shard_endpoint(base, shard)`: tcp port + shard, or an ipc path suffix; see `shard_layout`), and rank r
of a writer sends to rank r of each holder. A store therefore only ever holds one rank's bytes, and
content addressing (dedupe by key) stays correct. Writer and holder must run the same TP/PP/CP layout,
page size and host memory layout (SGLang requires the same of any storage reader). A rank-replicated
(MLA) KV cache is written by one rank only (SGLang's `is_storage_writer`) and read by all: its writer
sends each page to every TP rank of the holder, so each holder rank has a copy in its own process.

Status (for the sidecar agent's heartbeats): next to its holder store each rank answers a local ZMQ REP
socket at `status_bind` (`gateway.protocol.holder_status`): the store's bytes used, tokens held and
durable tokens per held request, keyed by the rid the pages were filed under. The answer is built under
the store's lock in one pass over the held requests (bounded by `MAX_STATUS_REQUESTS`) and encoded
after it; a request of another version is answered with an error. A status endpoint that cannot be
bound is logged and left out: the store still holds and serves pages.

Budget: the holder store keeps its byte budget and eviction policy (`CheckpointStore`); the writer's
memory is bounded by `max_pending_bytes` (pages copied but not yet queued by the KV plane's loop) and
the sender's `max_lag_bytes` per holder.

Degradation (never block SGLang's call, never wait on the network): a write copies the page bytes (SGLang
frees the host page once the call returns) and hands them to a private event-loop thread; it returns at
once. A dead or slow holder lets its queue grow to `max_lag_bytes`, then the request is abandoned on that
holder (a DROP is queued) and later pages for it there are dropped and counted; a full handoff queue
drops the batch; a full holder store refuses or evicts by its policy, on the holder. A failed write
returns False (SGLang logs it and stops that backup); reads never wait for anything but a short lock
held while the holder applies one received message.

Security (gateway/protocol/planes.py): the holder store is a CURVE server that admits only the cluster's
current members, each under its own identity, and the writer is a CURVE client of the holders' keys; both
under `auth`, by default this worker's keys and members from the plane file its sidecar agent writes
(`LUMEN_PLANE_FILE`; no file: the store refuses to start). The writer writes under its worker's current
incarnation as the members say (the agent's session; `incarnation` of the config until it is a member),
with a new sender when that changes.

Limits: a holder keeps per-request chains from page 0 (`CheckpointStore`), so a request whose first
pages SGLang stored before it was routed (a prefix another request wrote) is checkpointed only where
that holder already holds the prefix; elsewhere the holder refuses the gap and the gateway sees fewer
durable tokens. The filler calls `finish` or `drop` when a request ends (the holder's orphan TTL frees
what it never ends).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any, Final

import numpy as np
import structlog
import zmq
import zmq.asyncio

from gateway.protocol import holder_status as hs
from gateway.protocol.launch import Eviction
from gateway.protocol.plane_file import auth_from_plane_file
from gateway.protocol.planes import Member, PlaneAuth, Security
from worker_hooks.kv.receiver import StoreServer
from worker_hooks.kv.sender import CheckpointSender
from worker_hooks.kv.store import CheckpointStore, StoreStats
from worker_hooks.sglang.page_routes import PageRoute, RouteLookup, no_routes
from worker_hooks.sglang.storage_layout import (
    LumenStorageOptions,
    ShardLayout,
    shard_endpoint,
    status_endpoint_for,
)

log = structlog.get_logger("lumen.sglang.page_store")

Buffer = bytes | bytearray | memoryview
START_TIMEOUT_S: Final = 10.0
EXPIRE_PERIOD_MAX_S: Final = 5.0
MAX_CACHED_ENDPOINTS: Final = 4096
MAX_TRACKED: Final = 1 << 16  # requests whose last queued page (or abandonment) the store remembers


@dataclass(frozen=True, slots=True)
class PageStoreConfig:
    worker_id: str
    incarnation: int = 0
    shard: int = 0  # this rank's store (`ShardLayout.own`)
    write_to: tuple[int, ...] | None = None  # holder ranks its pages go to (None: (shard,))
    holder_bind: str | None = None  # this rank's store endpoint ("tcp://127.0.0.1:0" picks a port)
    status_bind: str | None = None  # its status socket (with a holder store only); None: none
    budget_bytes: int = 0  # this rank's store budget
    eviction: Eviction = Eviction.SHORTEST_PREFIX_FIRST
    orphan_ttl_s: float = 30.0
    frame_bytes: int = 1 << 20
    linger_s: float = 0.002
    max_lag_bytes: int = 256 << 20
    max_pending_bytes: int = 64 << 20
    drain_timeout_s: float = 0.1  # close(): how long queued pages may still go out

    @classmethod
    def for_rank(cls, opts: LumenStorageOptions, layout: ShardLayout) -> PageStoreConfig:
        bind = status = None
        if opts.holder_endpoint is not None:
            bind = shard_endpoint(opts.holder_endpoint, layout.own)
            base = opts.status_endpoint or status_endpoint_for(opts.holder_endpoint)
            status = shard_endpoint(base, layout.own)
        return cls(
            worker_id=opts.worker_id,
            incarnation=opts.incarnation,
            shard=layout.own,
            write_to=layout.write_to,
            holder_bind=bind,
            status_bind=status,
            budget_bytes=opts.holder_budget_bytes // layout.count,
            eviction=opts.eviction,
            orphan_ttl_s=opts.orphan_ttl_s,
            frame_bytes=opts.frame_bytes,
            max_lag_bytes=opts.max_lag_bytes,
            max_pending_bytes=opts.max_pending_bytes,
        )


@dataclass(frozen=True, slots=True)
class PageStoreStats:
    set_pages: int  # pages SGLang asked to write
    queued_pages: int  # (page, request) pairs handed to the KV plane
    unrouted_pages: int  # no live request routed: not checkpointed (reported as written)
    dropped_pages: int  # routed but not sent: holder abandoned, handoff full, route error
    abandoned: int  # (request, holder) checkpoints given up for lag (dead or slow holder)
    pending_bytes: int  # copied, not yet queued
    exists_queries: int
    hit_pages: int  # pages found by exists queries
    read_pages: int  # pages copied out by get
    miss_pages: int  # get of a page not held, or of another size than the target
    holder: StoreStats | None  # the local holder store


class _LockedStoreServer(StoreServer):
    """A StoreServer whose store mutations hold `lock`, so other threads may read the store."""

    def __init__(self, store: CheckpointStore, endpoint: str, *, lock: threading.Lock, **kw: Any) -> None:
        super().__init__(store, endpoint, **kw)
        self._lock = lock

    def handle(self, frames: list[memoryview], peer: Member | None = None) -> None:
        with self._lock:
            super().handle(frames, peer)


@dataclass(slots=True, eq=False)
class _Run:
    """Consecutive pages of one request, copied into one buffer, on their way to the KV plane."""

    rid: str
    holders: tuple[str, ...]
    first_page: int
    parent_key: str | None
    token_ids: list[int]
    page_size: int
    payload: memoryview
    n_pages: int


def _flat(data: Any) -> memoryview:
    mv = memoryview(data)
    return mv if mv.ndim == 1 and mv.format == "B" else mv.cast("B")


class PageStore:
    """HiCache's storage calls over Lumen's KV plane; every public method may be called from any thread."""

    def __init__(
        self,
        config: PageStoreConfig,
        routes: RouteLookup = no_routes,
        *,
        clock: Callable[[], float] = time.monotonic,
        auth: Security | None = None,
    ) -> None:
        """`auth`: the data planes' security; None: this worker's from the plane file (production)."""
        self.config = config
        self.auth = auth if auth is not None else auth_from_plane_file(config.worker_id)
        self._routes = routes
        self._clock = clock
        self._lock = threading.Lock()  # the holder store's contents
        self._count_lock = threading.Lock()  # counters and pending bytes
        self.store: CheckpointStore | None = None
        if config.holder_bind is not None:
            self.store = CheckpointStore(config.budget_bytes, config.eviction, config.orphan_ttl_s, clock)
        self._pending = 0
        self._set = self._queued = self._unrouted = self._dropped = self._abandoned_n = 0
        self._exists = self._hits = self._read = self._misses = 0
        # (rid, endpoint) given up for lag: written on the loop thread, read anywhere; bounded
        self._abandoned: dict[tuple[str, str], None] = {}
        self._next_page: dict[str, int] = {}  # loop thread: rid -> page after the last one queued; bounded
        self._write_to = config.write_to if config.write_to is not None else (config.shard,)
        self._endpoints: dict[str, tuple[str, ...]] = {}  # base holder endpoint -> the ones written to
        self.endpoint = ""
        self.status_endpoint = ""  # where the status socket listens ("" without one)
        self._status_answers = 0
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._sender: CheckpointSender | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._retiring: set[asyncio.Task[None]] = set()  # senders of older incarnations, draining
        started: Future[str] = Future()
        self._thread = threading.Thread(
            target=self._thread_main, args=(started,), name=f"lumen-pages-{config.shard}", daemon=True
        )
        self._thread.start()
        try:
            self.endpoint = started.result(timeout=START_TIMEOUT_S)
        except BaseException:
            self._closed = True
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._request_stop)
            self._thread.join(START_TIMEOUT_S)
            raise

    # -- writes ----------------------------------------------------------------------------------
    def set(self, key: str, value: Buffer) -> bool:
        return self.batch_set([key], [value])[0]

    def batch_set(self, keys: Sequence[str], values: Sequence[Any]) -> list[bool]:
        """Checkpoint pages (`values[i]` is page `keys[i]`'s bytes, any buffer) to their requests'
        holders. Per page: True when it was queued for at least one holder or no request wants it,
        False when it was dropped. Never waits on the network."""
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys for {len(values)} values")
        results = [True] * len(keys)
        runs: dict[str, list[tuple[int, PageRoute, memoryview]]] = {}  # rid -> [(i, route, page)]
        unrouted = dropped = 0
        for i, (key, value) in enumerate(zip(keys, values, strict=True)):
            try:
                routes = self._routes(key)
            except Exception:  # a filler bug must not break SGLang's backup thread
                log.exception("route_lookup_failed", key=key[:16])
                routes = ()
            routes = [r for r in routes if r.holders]  # a request without holders is not checkpointed
            if not routes:
                unrouted += 1
                continue
            wanted = False
            for route in routes:
                holders = self._shard_endpoints(route.holders)
                if all((route.rid, h) in self._abandoned for h in holders):
                    continue
                wanted = True
                runs.setdefault(route.rid, []).append((i, replace(route, holders=holders), _flat(value)))
            if not wanted:
                results[i] = False
                dropped += 1
        sent: set[int] = set()
        failed: set[int] = set()
        queued = 0
        for rid, pages in runs.items():
            for run_pages in _contiguous(pages):
                if self._hand_off(rid, run_pages):
                    queued += len(run_pages)
                    sent.update(i for i, _, _ in run_pages)
                else:
                    failed.update(i for i, _, _ in run_pages)
        # a page is written when the run of any request that wants it went out
        for i in failed - sent:
            results[i] = False
        with self._count_lock:
            self._set += len(keys)
            self._queued += queued
            self._unrouted += unrouted
            self._dropped += dropped + len(failed - sent)
        return results

    def _shard_endpoints(self, holders: tuple[str, ...]) -> tuple[str, ...]:
        """The endpoints of the holders' ranks this rank writes to (holders are base endpoints); a
        malformed one is left out."""
        out: list[str] = []
        for base in holders:
            endpoints = self._endpoints.get(base)
            if endpoints is None:
                try:
                    endpoints = tuple(shard_endpoint(base, s) for s in self._write_to)
                except ValueError:
                    log.warning("bad_holder_endpoint", endpoint=base[:200], shard=self.config.shard)
                    endpoints = ()
                if len(self._endpoints) < MAX_CACHED_ENDPOINTS:
                    self._endpoints[base] = endpoints
            out.extend(endpoints)
        return tuple(dict.fromkeys(out))

    def _hand_off(self, rid: str, pages: list[tuple[int, PageRoute, memoryview]]) -> bool:
        head = pages[0][1]
        holders = tuple(h for h in head.holders if (rid, h) not in self._abandoned)
        nbytes = sum(p.nbytes for _, _, p in pages)
        sizes = {p.nbytes for _, _, p in pages}
        page_size = len(head.token_ids)
        if not holders or len(sizes) != 1 or nbytes == 0 or page_size == 0:
            return False
        with self._count_lock:
            if self._closed or self._pending + nbytes > self.config.max_pending_bytes:
                return False
            self._pending += nbytes
        # the copy SGLang needs: its host page is reused once this call returns
        buf = np.empty(nbytes, dtype=np.uint8)
        offset = 0
        for _, _, page in pages:
            buf[offset : offset + page.nbytes] = np.frombuffer(page, dtype=np.uint8)
            offset += page.nbytes
        ids = [t for _, r, _ in pages for t in r.token_ids]
        run = _Run(rid, holders, head.page_index, head.parent_key, ids, page_size, buf.data, len(pages))
        try:
            self._loop.call_soon_threadsafe(self._enqueue, run)
        except RuntimeError:  # the loop is closed
            with self._count_lock:
                self._pending -= nbytes
            return False
        return True

    def finish(self, rid: str) -> None:
        """The request ended: its holders free its pages once the queued ones are sent (END)."""
        self._control(rid, drop=False)

    def drop(self, rid: str) -> None:
        """Cancel the request's checkpoint: queued pages discarded, DROP at its holders."""
        self._control(rid, drop=True)

    def _control(self, rid: str, *, drop: bool) -> None:
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._close_rid, rid, drop)

    # -- reads (the local holder store) ----------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: Sequence[str]) -> int:
        """How many of `keys`, from the first, the local holder store holds."""
        store = self.store
        n = 0
        if store is not None:
            with self._lock:
                for key in keys:
                    if store.page(key) is None:
                        break
                    n += 1
        with self._count_lock:
            self._exists += 1
            self._hits += n
        return n

    def get(self, key: str, target: Any = None) -> Any:
        """Page `key`'s bytes: copied into `target` (any writable buffer of the page's size), which is
        returned, or as new bytes when no target is given; None when not held or of another size."""
        return self.batch_get([key], [target])[0]

    def batch_get(self, keys: Sequence[str], targets: Sequence[Any] | None = None) -> list[Any]:
        if targets is not None and len(targets) != len(keys):
            raise ValueError(f"{len(keys)} keys for {len(targets)} targets")
        store = self.store
        views: list[memoryview | None] = [None] * len(keys)
        if store is not None:
            with self._lock:  # held pages are immutable: copy after releasing the lock
                views = [store.page(k) for k in keys]
        out: list[Any] = []
        read = misses = 0
        for i, view in enumerate(views):
            target = targets[i] if targets is not None else None
            if view is None:
                out.append(None)
                misses += 1
            elif target is None:
                out.append(bytes(view))
                read += 1
            else:
                dst = _flat(target)
                if dst.nbytes != view.nbytes or dst.readonly:
                    out.append(None)
                    misses += 1
                else:
                    dst[:] = view
                    out.append(target)
                    read += 1
        with self._count_lock:
            self._read += read
            self._misses += misses
        return out

    # -- observation -----------------------------------------------------------------------------
    def stats(self) -> PageStoreStats:
        holder = None
        if self.store is not None:
            with self._lock:
                holder = self.store.stats()
        with self._count_lock:
            return PageStoreStats(
                set_pages=self._set,
                queued_pages=self._queued,
                unrouted_pages=self._unrouted,
                dropped_pages=self._dropped,
                abandoned=self._abandoned_n,
                pending_bytes=self._pending,
                exists_queries=self._exists,
                hit_pages=self._hits,
                read_pages=self._read,
                miss_pages=self._misses,
                holder=holder,
            )

    def holder_status(self, max_requests: int = hs.MAX_STATUS_REQUESTS) -> hs.HolderStatus:
        """What the status socket answers: the local holder store now (empty without one)."""
        store = self.store
        if store is None:
            return hs.HolderStatus(shard=self.config.shard)
        limit = max(0, min(max_requests, hs.MAX_STATUS_REQUESTS))
        with self._lock:  # one pass over the held requests, no copy of pages
            s = store.stats()
            durable = store.durable_map(limit)
        return hs.HolderStatus(
            shard=self.config.shard,
            budget_bytes=s.budget_bytes,
            bytes_used=s.bytes_used,
            tokens_held=s.tokens_held,
            requests=s.requests,
            durable=durable,
            truncated=len(durable) < s.requests,
        )

    def clear(self) -> None:
        """Forget every page held locally (SGLang's `clear`, e.g. /flush_cache)."""
        if self.store is None:
            return
        with self._lock:
            for rid in self.store.rids():
                self.store.release(rid)

    def flush(self, timeout_s: float) -> bool:
        """Wait (bounded) until every handed-off page has been passed to zmq; for tests and shutdown."""
        if self._closed:
            return False
        deadline = self._clock() + timeout_s
        while True:
            with self._count_lock:
                pending = self._pending
            if not pending:
                break
            if self._clock() >= deadline:
                return False
            time.sleep(0.001)
        fut = asyncio.run_coroutine_threadsafe(self._flush(max(0.0, deadline - self._clock())), self._loop)
        try:
            return fut.result(timeout=max(0.0, deadline - self._clock()) + 1.0)
        except TimeoutError:
            return False

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the KV plane's thread: queued pages get `drain_timeout_s` to go out. Idempotent."""
        with self._count_lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._request_stop)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("page_store_thread_did_not_stop", shard=self.config.shard)

    # -- the KV plane's thread -------------------------------------------------------------------
    def _thread_main(self, started: Future[str]) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main(started))
        except BaseException as exc:  # startup failed: the constructor re-raises it
            if started.done():
                log.exception("page_store_thread_failed", shard=self.config.shard)
            else:
                started.set_exception(exc)
        finally:
            with contextlib.suppress(Exception):
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    async def _main(self, started: Future[str]) -> None:
        self._stop = asyncio.Event()
        ctx = zmq.asyncio.Context()
        server: StoreServer | None = None
        expire: asyncio.Task[None] | None = None
        status: asyncio.Task[None] | None = None
        cfg = self.config
        self._ctx = ctx
        try:
            self._sender = self._new_sender(self._incarnation())
            endpoint = ""
            if self.store is not None and cfg.holder_bind is not None:
                server = _LockedStoreServer(
                    self.store, cfg.holder_bind, auth=self.auth, ctx=ctx, lock=self._lock
                )
                endpoint = await server.start()
                expire = asyncio.create_task(self._expire(), name=f"lumen-pages-expire-{cfg.shard}")
                if cfg.status_bind is not None:
                    status = self._start_status(ctx, cfg.status_bind)
            started.set_result(endpoint)
            await self._stop.wait()
        finally:
            for task in (expire, status):
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
            if self._sender is not None:
                await self._sender.close(drain_timeout_s=cfg.drain_timeout_s)
            await asyncio.gather(*self._retiring, return_exceptions=True)
            if server is not None:
                await server.close()
            ctx.term()  # every socket is closed; waits at most for the sender's linger

    def _start_status(self, ctx: zmq.asyncio.Context, bind: str) -> asyncio.Task[None] | None:
        """Bind the status socket and serve it; None (logged) when it cannot be bound."""
        sock = ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 1 << 16)  # a request is a few bytes
        try:
            sock.bind(bind)
        except zmq.ZMQError as exc:
            sock.close(0)
            log.warning(
                "holder_status_bind_failed", endpoint=bind[:200], shard=self.config.shard, error=str(exc)
            )
            return None
        self.status_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return asyncio.create_task(self._serve_status(sock), name=f"lumen-pages-status-{self.config.shard}")

    async def _serve_status(self, sock: zmq.asyncio.Socket) -> None:
        try:
            while True:
                frames = await sock.recv_multipart(copy=True)
                req = hs.decode_request(frames[0]) if len(frames) == 1 else "one frame expected"
                if isinstance(req, str):
                    answer = hs.HolderStatus(error=req, shard=self.config.shard)
                else:
                    answer = self.holder_status(req.max_requests)
                await sock.send(hs.encode(answer), copy=False)
                self._status_answers += 1
        finally:
            sock.close(0)

    def _request_stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    def _incarnation(self) -> int:
        """This worker's incarnation to write under: the members' entry for it, else the config's."""
        if isinstance(self.auth, PlaneAuth):
            me = self.auth.members.current(self.config.worker_id)
            if me is not None:
                return me.incarnation
        return self.config.incarnation

    def _new_sender(self, incarnation: int) -> CheckpointSender:
        cfg = self.config
        return CheckpointSender(
            cfg.worker_id,
            incarnation,
            auth=self.auth,
            ctx=self._ctx,
            frame_bytes=cfg.frame_bytes,
            linger_s=cfg.linger_s,
            max_lag_bytes=cfg.max_lag_bytes,
            clock=self._clock,
        )

    def _current_sender(self) -> CheckpointSender | None:
        """The sender of the current incarnation (a new one when it changed: the holders take pages only
        under a member's current incarnation; the old one drains what it queued)."""
        sender = self._sender
        if sender is None or self._closed:
            return sender
        incarnation = self._incarnation()
        if incarnation != sender.incarnation:
            log.info(
                "page_store_new_incarnation",
                worker_id=self.config.worker_id,
                old=sender.incarnation,
                new=incarnation,
            )
            self._sender = self._new_sender(incarnation)
            task = self._loop.create_task(sender.close(drain_timeout_s=self.config.drain_timeout_s))
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)
            # chains restart under the new incarnation: explicit parents; abandonment was per sender
            self._next_page.clear()
            self._abandoned.clear()
            sender = self._sender
        return sender

    def _enqueue(self, run: _Run) -> None:
        with self._count_lock:
            self._pending -= run.payload.nbytes
        sender = self._current_sender()
        if sender is None or self._closed:
            self._count_dropped(run.n_pages)
            return
        holders = [h for h in run.holders if (run.rid, h) not in self._abandoned]
        if not holders:
            self._count_dropped(run.n_pages)
            return
        # an explicit parent only where the run does not continue what was queued before
        parent = None if self._next_page.get(run.rid) == run.first_page else run.parent_key
        try:
            sender.send_pages(
                run.rid,
                holders,
                run.first_page,
                run.token_ids,
                run.payload,
                page_size=run.page_size,
                parent_key=parent,
            )
        except (ValueError, RuntimeError):  # a bad endpoint from the route filler; closing
            log.exception("checkpoint_send_refused", rid=run.rid, holders=holders)
            self._count_dropped(run.n_pages)
            return
        self._next_page.pop(run.rid, None)  # re-inserted last: the oldest request is forgotten first
        self._next_page[run.rid] = run.first_page + run.n_pages
        _bound(self._next_page)
        gone = sender.abandoned()
        for a in gone:
            self._abandoned[(a.rid, a.endpoint)] = None
            _bound(self._abandoned)
            log.info("checkpoint_abandoned", rid=a.rid, holder=a.endpoint, dropped_bytes=a.dropped_bytes)
        if gone:
            with self._count_lock:
                self._abandoned_n += len(gone)

    def _close_rid(self, rid: str, drop: bool) -> None:
        sender = self._current_sender()
        if sender is None:
            return
        if drop:
            sender.drop(rid)
        else:
            sender.end(rid)
        self._next_page.pop(rid, None)
        for pair in [p for p in self._abandoned if p[0] == rid]:
            del self._abandoned[pair]

    def _count_dropped(self, n: int) -> None:
        with self._count_lock:
            self._dropped += n

    async def _flush(self, timeout_s: float) -> bool:
        return await self._sender.flush(timeout_s) if self._sender is not None else False

    async def _expire(self) -> None:
        store = self.store
        if store is None:
            return
        period = min(store.orphan_ttl_s / 4, EXPIRE_PERIOD_MAX_S)
        while True:
            await asyncio.sleep(period)
            with self._lock:
                expired = store.expire_orphans()
            if expired:
                log.info("checkpoint_orphans_expired", shard=self.config.shard, rids=expired)


def _bound(d: dict[Any, Any], limit: int = MAX_TRACKED) -> None:
    """Forget the oldest entries of a per-request dict whose requests were never finished or dropped:
    a forgotten one costs only an explicit parent key on its next run, or a retry on a dead holder."""
    while len(d) > limit:
        del d[next(iter(d))]


def _contiguous(
    pages: list[tuple[int, PageRoute, memoryview]],
) -> Iterable[list[tuple[int, PageRoute, memoryview]]]:
    """Split one request's pages into runs of consecutive page indices with one holder set."""
    run: list[tuple[int, PageRoute, memoryview]] = []
    for item in pages:
        if run and (
            item[1].page_index != run[-1][1].page_index + 1
            or item[1].holders != run[-1][1].holders
            or item[2].nbytes != run[-1][2].nbytes
        ):
            yield run
            run = []
        run.append(item)
    if run:
        yield run
