"""The write side of a page store (`set`, `batch_set`, `finish`, `drop`): SGLang's pages to the
checkpoint holders of the requests they belong to, over the KV plane (DESIGN 4.4).

A page goes to its requests' holders through `CheckpointSender` (ZMQ PUSH, grouped frames, a lag bound
per holder). SGLang's storage calls carry no request id and no token ids, so a *route lookup* says where
a page goes: a callable `key -> [PageRoute]` (one route per live request whose sequence contains the
page; none: the page is not checkpointed). `RequestRoutes` (page_routes.py) is the table that fills it:
the SGLang plugin (or the agent) calls `admit(rid, token_ids, holders)` when a request arrives with the
gateway's `kv_hints`, `extend` as its tokens grow, `set_holders` when the gateway re-homes it, `retire`
when it ends. The table hashes the request's pages itself, so a route carries the page's token ids and
position: the holder recomputes every key from token ids as for Lumen's own engines (keys are never
trusted from the wire), and a page SGLang hashed from other tokens (another `--page-size`, another
namespace) finds no route. Rank r of a writer sends to rank(s) `write_to` of each holder
(`shard_endpoint`).

Threads: `batch_set`, `finish` and `drop` run on SGLang's threads; the sender lives on the page store's
event-loop thread (`loop`), where `open`, `flush` and `close` run and every handed-off run is queued.

Budget: the writer's memory is bounded by `max_pending_bytes` (pages copied but not yet queued by the
KV plane's loop) and the sender's `max_lag_bytes` per holder.

Degradation (never block SGLang's call, never wait on the network): a write copies the page bytes (SGLang
frees the host page once the call returns) and hands them to the event-loop thread; it returns at once.
A dead or slow holder lets its queue grow to `max_lag_bytes`, then the request is abandoned on that
holder (a DROP is queued) and later pages for it there are dropped and counted; a full handoff queue
drops the batch. A failed write returns False (SGLang logs it and stops that backup).

Incarnations: the writer writes under its worker's current incarnation as the members say (the agent's
session; `incarnation` of the config until it is a member), with a new sender when that changes.

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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

import numpy as np
import structlog
import zmq.asyncio

from gateway.protocol.planes import PlaneAuth, Security
from worker_hooks.kv.sender import CheckpointSender
from worker_hooks.sglang.page_bytes import flat
from worker_hooks.sglang.page_routes import PageRoute, RouteLookup
from worker_hooks.sglang.page_store_config import PageStoreConfig
from worker_hooks.sglang.storage_layout import shard_endpoint

log = structlog.get_logger("lumen.sglang.page_store")

MAX_CACHED_ENDPOINTS: Final = 4096
MAX_TRACKED: Final = 1 << 16  # requests whose last queued page (or abandonment) the store remembers


@dataclass(frozen=True, slots=True)
class WriteStats:
    set_pages: int
    queued_pages: int
    unrouted_pages: int
    dropped_pages: int
    abandoned: int
    pending_bytes: int


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


class PageWriter:
    """Routes, copies and queues pages; the public methods but `open`/`flush`/`close` may be called from
    any thread."""

    def __init__(
        self,
        config: PageStoreConfig,
        routes: RouteLookup,
        *,
        auth: Security,
        clock: Callable[[], float],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.config = config
        self.auth = auth
        self._routes = routes
        self._clock = clock
        self._loop = loop
        self._lock = threading.Lock()  # counters, pending bytes, closed
        self._pending = 0
        self._set = self._queued = self._unrouted = self._dropped = self._abandoned_n = 0
        # (rid, endpoint) given up for lag: written on the loop thread, read anywhere; bounded
        self._abandoned: dict[tuple[str, str], None] = {}
        self._next_page: dict[str, int] = {}  # loop thread: rid -> page after the last one queued; bounded
        self._write_to = config.write_to if config.write_to is not None else (config.shard,)
        self._endpoints: dict[str, tuple[str, ...]] = {}  # base holder endpoint -> the ones written to
        self.closed = False
        self._sender: CheckpointSender | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._retiring: set[asyncio.Task[None]] = set()  # senders of older incarnations, draining

    # -- SGLang's threads ------------------------------------------------------------------------
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
                runs.setdefault(route.rid, []).append((i, replace(route, holders=holders), flat(value)))
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
        with self._lock:
            self._set += len(keys)
            self._queued += queued
            self._unrouted += unrouted
            self._dropped += dropped + len(failed - sent)
        return results

    def finish(self, rid: str) -> None:
        """The request ended: its holders free its pages once the queued ones are sent (END)."""
        self._control(rid, drop=False)

    def drop(self, rid: str) -> None:
        """Cancel the request's checkpoint: queued pages discarded, DROP at its holders."""
        self._control(rid, drop=True)

    def shut(self) -> bool:
        """Take no more writes (the store is closing); False when already shut."""
        with self._lock:
            if self.closed:
                return False
            self.closed = True
            return True

    def pending_bytes(self) -> int:
        with self._lock:
            return self._pending

    def stats(self) -> WriteStats:
        with self._lock:
            return WriteStats(
                set_pages=self._set,
                queued_pages=self._queued,
                unrouted_pages=self._unrouted,
                dropped_pages=self._dropped,
                abandoned=self._abandoned_n,
                pending_bytes=self._pending,
            )

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
        with self._lock:
            if self.closed or self._pending + nbytes > self.config.max_pending_bytes:
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
            with self._lock:
                self._pending -= nbytes
            return False
        return True

    def _control(self, rid: str, *, drop: bool) -> None:
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._close_rid, rid, drop)

    # -- the event-loop thread -------------------------------------------------------------------
    def open(self, ctx: zmq.asyncio.Context) -> None:
        """Start the sender of the current incarnation on `ctx`."""
        self._ctx = ctx
        self._sender = self._new_sender(self._incarnation())

    async def flush(self, timeout_s: float) -> bool:
        return await self._sender.flush(timeout_s) if self._sender is not None else False

    async def close(self) -> None:
        """Close the sender (queued pages get `drain_timeout_s`) and wait for older ones draining."""
        if self._sender is not None:
            await self._sender.close(drain_timeout_s=self.config.drain_timeout_s)
        await asyncio.gather(*self._retiring, return_exceptions=True)

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
        if sender is None or self.closed:
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
        with self._lock:
            self._pending -= run.payload.nbytes
        sender = self._current_sender()
        if sender is None or self.closed:
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
            with self._lock:
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
        with self._lock:
            self._dropped += n


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
