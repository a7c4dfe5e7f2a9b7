"""The background half of Lumen's SGLang plugin: takes staged page copies off the scheduler thread and
sends them over the KV plane (DESIGN 4.4). No sglang, no torch.

The scheduler thread `submit`s, in step order, `ShipJob`s (one per decode step: the host buffer a
device→host copy is filling, and which page runs of which requests it holds) and `Control`s (END, DROP),
and returns at once. One private thread runs an asyncio loop with one `CheckpointSender` per (serving
worker, epoch); it takes the items in order: for a job it waits (polling, never the scheduler) until the
copy is done, copies each run's bytes into memory of its own, releases its staging (the ring's space
is reused), and queues the run with `send_pages`; a control goes to `end` / `drop`. Order is kept
per request: pages in order, END or DROP after them.

The sender's lag bound gives a request up on a holder that lags (it queues the DROP itself);
`given_up()` drains those (request, endpoint) pairs for the planner. A job whose bytes cannot be read
(the copy failed) is dropped whole and its requests are reported given up on all their endpoints.

Each sender sends under the plane security `keyring(src_worker)` gives (gateway/protocol/planes.py): in
SGLang, the keys of the plane file its sidecar agent wrote (`FileKeyring`), so the server writes only
as the worker whose keys it holds; a run for another worker is refused and given up.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Final

import numpy as np
import structlog
import zmq.asyncio

from gateway.protocol.plane_file import Keyring
from worker_hooks.kv.sender import CheckpointSender
from worker_hooks.sglang.plugin_logic import Control, ControlKind, PluginOptions, parent_key
from worker_hooks.sglang.ship_jobs import PageRun, ShipJob
from worker_hooks.sglang.staging import Staging

log = structlog.get_logger("lumen.sglang.plugin")

START_TIMEOUT_S: Final = 10.0
WATCH_BUSY_S: Final = 0.001  # how often the holders' queues are read while any holds bytes
WATCH_IDLE_S: Final = 0.01
MAX_SENDERS: Final = 8  # (worker, epoch) pairs kept open; the least recently used beyond are closed


@dataclass(slots=True)
class ShipperStats:
    jobs: int = 0
    runs: int = 0
    pages: int = 0
    bytes: int = 0
    controls: int = 0
    failed_jobs: int = 0


@dataclass(slots=True, eq=False)
class _Queue:
    items: deque[ShipJob | Control] = field(default_factory=deque)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Shipper:
    def __init__(
        self,
        options: PluginOptions,
        staging: Staging,
        *,
        keyring: Keyring,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.options, self.staging = options, staging
        self._keyring = keyring
        self._clock = clock
        self._q = _Queue()
        self._given_up: list[tuple[str, str]] = []
        self._given_up_lock = threading.Lock()
        self.stats = ShipperStats()
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._wake: asyncio.Event | None = None
        self._stop: asyncio.Event | None = None
        self._senders: dict[tuple[str, int], CheckpointSender] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._busy = False
        self._queued: dict[str, int] = {}  # endpoint -> bytes in the KV plane's queues (loop thread)
        self._pending: dict[str, int] = {}  # endpoint -> bytes submitted, not yet sent (under the lock)
        started: Future[None] = Future()
        self._thread = threading.Thread(
            target=self._thread_main, args=(started,), name="lumen-sglang-plugin", daemon=True
        )
        self._thread.start()
        started.result(timeout=START_TIMEOUT_S)

    # -- the scheduler thread's side ------------------------------------------------------------
    def submit(self, item: ShipJob | Control) -> bool:
        """Queue a job or a control after everything queued before; never blocks. False when closed
        (a job's staging is then released here)."""
        if self._closed:
            if isinstance(item, ShipJob):
                self._discard(item)
            return False
        with self._q.lock:
            self._q.items.append(item)
            if isinstance(item, ShipJob):
                for run in item.runs:
                    for e in run.copy.endpoints:
                        self._pending[e] = self._pending.get(e, 0) + run.copy.nbytes
        try:
            self._loop.call_soon_threadsafe(self._poke)
        except RuntimeError:  # the loop is closed
            return False
        return True

    def given_up(self) -> list[tuple[str, str]]:
        """(rid, endpoint) pairs the KV plane gave up since the last call (the holder lagged)."""
        with self._given_up_lock:
            out, self._given_up = self._given_up, []
        return out

    def congested(self) -> frozenset[str]:
        """Holder endpoints with more than half their lag bound on the way (submitted here and not yet
        sent, or queued in the KV plane's sender): pages for them wait (the planner copies nothing for a
        request all of whose holders are congested) instead of piling up until the sender gives the
        request up. Cheap: a few endpoints."""
        limit = max(1, self.options.max_lag_bytes // 2)
        queued = self._queued
        with self._q.lock:
            pending = dict(self._pending)
        return frozenset(
            e for e in queued.keys() | pending.keys() if queued.get(e, 0) + pending.get(e, 0) >= limit
        )

    def idle(self) -> bool:
        with self._q.lock:
            return not self._q.items and not self._busy

    def flush(self, timeout_s: float) -> bool:
        """Wait (bounded) until everything submitted went to the KV plane's sockets. Tests, shutdown."""
        deadline = self._clock() + timeout_s
        while not self.idle():
            if self._clock() >= deadline:
                return False
            time.sleep(0.001)
        if self._closed:
            return False
        fut = asyncio.run_coroutine_threadsafe(self._flush(max(0.0, deadline - self._clock())), self._loop)
        try:
            return fut.result(timeout=max(0.0, deadline - self._clock()) + 1.0)
        except TimeoutError:
            return False

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop: what is queued gets `drain_timeout_s` to go out. Idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._request_stop)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("plugin_shipper_did_not_stop")

    # -- the loop thread ------------------------------------------------------------------------
    def _thread_main(self, started: Future[None]) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main(started))
        except BaseException as exc:
            if started.done():
                log.exception("plugin_shipper_failed")
            else:
                started.set_exception(exc)
        finally:
            with contextlib.suppress(Exception):
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()
            # whatever was never taken goes back to staging
            with self._q.lock:
                left, self._q.items = list(self._q.items), deque()
            for item in left:
                if isinstance(item, ShipJob):
                    self._discard(item)

    async def _main(self, started: Future[None]) -> None:
        self._wake, self._stop = asyncio.Event(), asyncio.Event()
        self._ctx = zmq.asyncio.Context()
        started.set_result(None)
        worker = asyncio.create_task(self._work(), name="lumen-plugin-ship")
        watch = asyncio.create_task(self._watch_queues(), name="lumen-plugin-queues")
        try:
            await self._stop.wait()
            for task in (worker, watch):
                task.cancel()
            await asyncio.gather(worker, watch, return_exceptions=True)
            # what is still queued: controls and ready jobs go out within the drain time
            deadline = self._clock() + self.options.drain_timeout_s
            while True:
                item = self._pop()
                if item is None or self._clock() > deadline:
                    if item is not None and isinstance(item, ShipJob):
                        self._discard(item)
                    break
                if isinstance(item, ShipJob) and not item.copied():
                    self._discard(item)
                    continue
                try:
                    self._take(item)
                except Exception:
                    log.exception("plugin_ship_failed")
        finally:
            for sender in self._senders.values():
                await sender.close(drain_timeout_s=self.options.drain_timeout_s)
            self._senders.clear()
            self._ctx.term()

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _request_stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    def _pop(self) -> ShipJob | Control | None:
        with self._q.lock:
            if not self._q.items:
                return None
            self._busy = True
            return self._q.items.popleft()

    async def _work(self) -> None:
        assert self._wake is not None
        while True:
            item = self._pop()
            if item is None:
                self._wake.clear()
                with self._q.lock:
                    empty = not self._q.items
                if empty:
                    await self._wake.wait()
                continue
            try:
                if isinstance(item, ShipJob):
                    await item.until_copied()
                self._take(item)
            except asyncio.CancelledError:
                if isinstance(item, ShipJob):
                    self._discard(item)
                raise
            except Exception:  # never let one bad item stop the loop
                log.exception("plugin_ship_failed")
            finally:
                with self._q.lock:
                    self._busy = False

    async def _watch_queues(self) -> None:
        """Publish the bytes in the KV plane's queue of every holder endpoint (`congested`)."""
        while True:
            self._publish_queued()
            await asyncio.sleep(WATCH_BUSY_S if any(self._queued.values()) else WATCH_IDLE_S)

    def _publish_queued(self) -> None:
        queued: dict[str, int] = {}
        for sender in self._senders.values():
            for endpoint in sender.stats():
                queued[endpoint] = queued.get(endpoint, 0) + sender.queued_bytes(endpoint)
        self._queued = queued  # one assignment: the scheduler thread reads a whole snapshot

    def _take(self, item: ShipJob | Control) -> None:
        if isinstance(item, Control):
            self._control(item)
        else:
            self._ship(item)

    def _sender(self, src_worker: str, epoch: int) -> CheckpointSender:
        key = (src_worker, epoch)
        sender = self._senders.pop(key, None)
        if sender is None:
            assert self._ctx is not None
            sender = CheckpointSender(
                src_worker,
                epoch,
                auth=self._keyring(src_worker),  # PlaneSecurityError (a RuntimeError): no keys for it
                ctx=self._ctx,
                frame_bytes=self.options.frame_bytes,
                max_lag_bytes=self.options.max_lag_bytes,
                clock=self._clock,
            )
            if len(self._senders) >= MAX_SENDERS:
                oldest = next(iter(self._senders))
                old = self._senders.pop(oldest)
                self._loop.create_task(old.close(drain_timeout_s=self.options.drain_timeout_s))
        self._senders[key] = sender  # most recently used last
        return sender

    def _ship(self, job: ShipJob) -> None:
        try:
            data = job.data()
        except Exception:
            log.exception("plugin_copy_failed", runs=len(job.runs))
            self.stats.failed_jobs += 1
            self._discard(job)
            self._report_failed(job.runs)
            return
        self.stats.jobs += 1
        for i, run in enumerate(job.runs):
            c = run.copy
            try:
                # ours: the staging ring's space goes back at once
                page_bytes = np.frombuffer(data[run.offset : run.offset + c.nbytes], dtype=np.uint8).copy()
            except Exception:
                log.exception("plugin_copy_failed", rid=c.rid)
                self.stats.failed_jobs += 1
                self._discard(ShipJob(job.runs[i:], job.ready, job.data))
                self._report_failed(job.runs[i:])
                return
            self.staging.release(c.offset)
            self._taken(run)
            parent = parent_key(run.prefix_ids or [], c.page_size, c.seed) if c.starts_chain else None
            try:
                sender = self._sender(c.src_worker, c.epoch)
                sender.send_pages(
                    c.rid,
                    c.endpoints,
                    c.first_page,
                    run.token_ids,
                    page_bytes.data,
                    page_size=c.page_size,
                    parent_key=parent,
                    dtype=job.dtype,
                    shape=job.shape,
                )
            except (ValueError, RuntimeError):
                log.exception("plugin_send_refused", rid=c.rid)
                self._report_failed([run])
                continue
            self.stats.runs += 1
            self.stats.pages += c.n_pages
            self.stats.bytes += c.nbytes
            self._collect(sender)
        self._publish_queued()

    def _control(self, ctl: Control) -> None:
        sender = self._senders.get((ctl.src_worker, ctl.epoch))
        if sender is None:
            return  # nothing was ever sent for it by this process
        if ctl.kind is ControlKind.END:
            sender.end(ctl.rid)
        else:
            sender.drop(ctl.rid)
        self.stats.controls += 1

    def _collect(self, sender: CheckpointSender) -> None:
        gone = sender.abandoned()
        if not gone:
            return
        for a in gone:
            log.info("checkpoint_abandoned", rid=a.rid, holder=a.endpoint, dropped_bytes=a.dropped_bytes)
        with self._given_up_lock:
            self._given_up.extend((a.rid, a.endpoint) for a in gone)

    def _report_failed(self, runs: Sequence[PageRun]) -> None:
        with self._given_up_lock:
            self._given_up.extend((r.copy.rid, e) for r in runs for e in r.copy.endpoints)

    def _discard(self, job: ShipJob) -> None:
        for run in job.runs:
            self.staging.release(run.copy.offset)
            self._taken(run)

    def _taken(self, run: PageRun) -> None:
        with self._q.lock:
            for e in run.copy.endpoints:
                left = self._pending.get(e, 0) - run.copy.nbytes
                if left > 0:
                    self._pending[e] = left
                else:
                    self._pending.pop(e, None)

    async def _flush(self, timeout_s: float) -> bool:
        deadline = self._clock() + timeout_s
        for sender in list(self._senders.values()):
            if not await sender.flush(max(0.0, deadline - self._clock())):
                return False
        return True
