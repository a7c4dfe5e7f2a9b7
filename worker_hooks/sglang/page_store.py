"""HiCache storage semantics over Lumen's KV checkpoint plane, without SGLang (DESIGN 4.4).

SGLang's HiCache calls a storage backend with page keys (its page hash, equal to
`gateway.protocol.pagekeys`) and page bytes, from its own threads (backup, prefetch). `PageStore`
answers those calls with Lumen's machinery; `hicache_backend.LumenHiCacheStorage` is the thin SGLang
subclass that converts tensors and host-pool pages to bytes and calls it. Nothing here imports sglang
or torch, so the default test run exercises all of it.

`PageStore` is one rank's store: it owns the private event-loop thread the KV plane runs on (one zmq
context, started in the constructor, stopped by `close`) and joins its two sides:

- writing (`set`, `batch_set`, `finish`, `drop`; page_writer.py): a page goes to the checkpoint holders
  of the requests it belongs to, which a route lookup (page_routes.py) names, over the KV plane; a
  write copies the page and returns at once, never waiting on the network;
- reading (`exists`, `batch_exists`, `get`, `batch_get`, `clear`; local_holder.py): answered from the
  local holder store, the pages other workers checkpointed here, which also answers the sidecar
  agent's status socket.

TP separation by partition: page keys carry no rank, and every TP rank writes its own shard of a page
under the same key. Each rank runs its own page store with its own holder store at its own endpoint
(`shard_endpoint(base, shard)`: tcp port + shard, or an ipc path suffix; see `shard_layout`), and rank r
of a writer sends to rank r of each holder. A store therefore only ever holds one rank's bytes, and
content addressing (dedupe by key) stays correct. Writer and holder must run the same TP/PP/CP layout,
page size and host memory layout (SGLang requires the same of any storage reader). A rank-replicated
(MLA) KV cache is written by one rank only (SGLang's `is_storage_writer`) and read by all: its writer
sends each page to every TP rank of the holder, so each holder rank has a copy in its own process.

Security (gateway/protocol/planes.py): the holder store is a CURVE server that admits only the cluster's
current members, each under its own identity, and the writer is a CURVE client of the holders' keys; both
under `auth`, by default this worker's keys and members from the plane file its sidecar agent writes
(`LUMEN_PLANE_FILE`; no file: the store refuses to start).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Final

import structlog
import zmq.asyncio

from gateway.protocol import holder_status as hs
from gateway.protocol.plane_file import auth_from_plane_file
from gateway.protocol.planes import Security
from worker_hooks.kv.store import CheckpointStore
from worker_hooks.sglang.local_holder import LocalHolder
from worker_hooks.sglang.page_bytes import Buffer
from worker_hooks.sglang.page_routes import RouteLookup, no_routes
from worker_hooks.sglang.page_store_config import PageStoreConfig, PageStoreStats
from worker_hooks.sglang.page_writer import PageWriter

log = structlog.get_logger("lumen.sglang.page_store")

START_TIMEOUT_S: Final = 10.0


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
        self._clock = clock
        self._holder = LocalHolder(config, clock)
        self.endpoint = ""
        self._loop = asyncio.new_event_loop()
        self._writer = PageWriter(config, routes, auth=self.auth, clock=clock, loop=self._loop)
        self._stop: asyncio.Event | None = None
        started: Future[str] = Future()
        self._thread = threading.Thread(
            target=self._thread_main, args=(started,), name=f"lumen-pages-{config.shard}", daemon=True
        )
        self._thread.start()
        try:
            self.endpoint = started.result(timeout=START_TIMEOUT_S)
        except BaseException:
            self._writer.shut()
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._request_stop)
            self._thread.join(START_TIMEOUT_S)
            raise

    @property
    def store(self) -> CheckpointStore | None:
        """The local holder store (None without `holder_bind`)."""
        return self._holder.store

    @property
    def status_endpoint(self) -> str:
        """Where the status socket listens ("" without one)."""
        return self._holder.status_endpoint

    # -- writes ----------------------------------------------------------------------------------
    def set(self, key: str, value: Buffer) -> bool:
        return self.batch_set([key], [value])[0]

    def batch_set(self, keys: Sequence[str], values: Sequence[Any]) -> list[bool]:
        """Checkpoint pages (`values[i]` is page `keys[i]`'s bytes, any buffer) to their requests'
        holders. Per page: True when it was queued for at least one holder or no request wants it,
        False when it was dropped. Never waits on the network."""
        return self._writer.batch_set(keys, values)

    def finish(self, rid: str) -> None:
        """The request ended: its holders free its pages once the queued ones are sent (END)."""
        self._writer.finish(rid)

    def drop(self, rid: str) -> None:
        """Cancel the request's checkpoint: queued pages discarded, DROP at its holders."""
        self._writer.drop(rid)

    # -- reads (the local holder store) ----------------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: Sequence[str]) -> int:
        """How many of `keys`, from the first, the local holder store holds."""
        return self._holder.batch_exists(keys)

    def get(self, key: str, target: Any = None) -> Any:
        """Page `key`'s bytes: copied into `target` (any writable buffer of the page's size), which is
        returned, or as new bytes when no target is given; None when not held or of another size."""
        return self.batch_get([key], [target])[0]

    def batch_get(self, keys: Sequence[str], targets: Sequence[Any] | None = None) -> list[Any]:
        return self._holder.batch_get(keys, targets)

    def clear(self) -> None:
        """Forget every page held locally (SGLang's `clear`, e.g. /flush_cache)."""
        self._holder.clear()

    # -- observation -----------------------------------------------------------------------------
    def stats(self) -> PageStoreStats:
        reads = self._holder.stats()
        writes = self._writer.stats()
        return PageStoreStats(
            set_pages=writes.set_pages,
            queued_pages=writes.queued_pages,
            unrouted_pages=writes.unrouted_pages,
            dropped_pages=writes.dropped_pages,
            abandoned=writes.abandoned,
            pending_bytes=writes.pending_bytes,
            exists_queries=reads.exists_queries,
            hit_pages=reads.hit_pages,
            read_pages=reads.read_pages,
            miss_pages=reads.miss_pages,
            holder=reads.holder,
        )

    def holder_status(self, max_requests: int = hs.MAX_STATUS_REQUESTS) -> hs.HolderStatus:
        """What the status socket answers: the local holder store now (empty without one)."""
        return self._holder.holder_status(max_requests)

    # -- lifecycle -------------------------------------------------------------------------------
    def flush(self, timeout_s: float) -> bool:
        """Wait (bounded) until every handed-off page has been passed to zmq; for tests and shutdown."""
        if self._writer.closed:
            return False
        deadline = self._clock() + timeout_s
        while self._writer.pending_bytes():
            if self._clock() >= deadline:
                return False
            time.sleep(0.001)
        fut = asyncio.run_coroutine_threadsafe(
            self._writer.flush(max(0.0, deadline - self._clock())), self._loop
        )
        try:
            return fut.result(timeout=max(0.0, deadline - self._clock()) + 1.0)
        except TimeoutError:
            return False

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the KV plane's thread: queued pages get `drain_timeout_s` to go out. Idempotent."""
        if not self._writer.shut():
            return
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
        try:
            self._writer.open(ctx)
            endpoint = await self._holder.start(ctx, self.auth)
            started.set_result(endpoint)
            await self._stop.wait()
        finally:
            await self._holder.stop_tasks()
            await self._writer.close()
            await self._holder.close()
            ctx.term()  # every socket is closed; waits at most for the sender's linger

    def _request_stop(self) -> None:
        if self._stop is not None:
            self._stop.set()
