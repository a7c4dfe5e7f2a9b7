"""The read side of a page store (`exists`, `batch_exists`, `get`, `batch_get`, `clear`): the pages other
workers checkpointed to this rank, in a holder store in this process, and the status socket the sidecar
agent polls about it (DESIGN 4.4).

Reading: answered from the *local* holder store, a `CheckpointStore` behind a `StoreServer` bound at
`holder_bind`. So a server that restores a request reads the pages its own co-located holder store was
sent, and a read never touches the network; it never waits for anything but a short lock held while
the holder applies one received message. Without `holder_bind` there is no store and every read misses.

Status (for the sidecar agent's heartbeats): next to its holder store each rank answers a local ZMQ REP
socket at `status_bind` (`gateway.protocol.holder_status`): the store's bytes used, tokens held and
durable tokens per held request, keyed by the rid the pages were filed under. The answer is built under
the store's lock in one pass over the held requests (bounded by `MAX_STATUS_REQUESTS`) and encoded
after it; a request of another version is answered with an error. A status endpoint that cannot be
bound is logged and left out: the store still holds and serves pages.

Budget: the holder store keeps its byte budget and eviction policy (`CheckpointStore`); a full store
refuses or evicts by its policy. Requests whose writer never ended them go after `orphan_ttl_s`.

Threads: reads run on SGLang's threads; the store server, the orphan expiry and the status socket run on
the page store's event-loop thread (`start`, `stop_tasks`, `close`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import structlog
import zmq
import zmq.asyncio

from gateway.protocol import holder_status as hs
from gateway.protocol.planes import Member, Security
from gateway.protocol.secrets import private_dir, runtime_dir
from worker_hooks.kv.receiver import StoreServer
from worker_hooks.kv.store import CheckpointStore, StoreStats
from worker_hooks.sglang.page_bytes import flat
from worker_hooks.sglang.page_store_config import PageStoreConfig

log = structlog.get_logger("lumen.sglang.page_store")

EXPIRE_PERIOD_MAX_S: Final = 5.0


@dataclass(frozen=True, slots=True)
class ReadStats:
    exists_queries: int
    hit_pages: int
    read_pages: int
    miss_pages: int
    holder: StoreStats | None


class _LockedStoreServer(StoreServer):
    """A StoreServer whose store mutations hold `lock`, so other threads may read the store."""

    def __init__(self, store: CheckpointStore, endpoint: str, *, lock: threading.Lock, **kw: Any) -> None:
        super().__init__(store, endpoint, **kw)
        self._lock = lock

    def handle(self, frames: list[memoryview], peer: Member | None = None) -> None:
        with self._lock:
            super().handle(frames, peer)


class LocalHolder:
    """This rank's holder store (None without `holder_bind`), its reads and its status socket."""

    def __init__(self, config: PageStoreConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self._lock = threading.Lock()  # the holder store's contents
        self._count_lock = threading.Lock()  # the read counters
        self.store: CheckpointStore | None = None
        if config.holder_bind is not None:
            self.store = CheckpointStore(config.budget_bytes, config.eviction, config.orphan_ttl_s, clock)
        self._exists = self._hits = self._read = self._misses = 0
        self.status_endpoint = ""  # where the status socket listens ("" without one)
        self._status_inode = -1  # the ipc socket file bound, removed at close if still ours
        self.status_answers = 0
        self._server: StoreServer | None = None
        self._tasks: list[asyncio.Task[None]] = []  # the orphan expiry, the status socket

    # -- reads (any thread) ----------------------------------------------------------------------
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

    def batch_get(self, keys: Sequence[str], targets: Sequence[Any] | None = None) -> list[Any]:
        """Each page's bytes: copied into its target (any writable buffer of the page's size), which is
        returned, or as new bytes without a target; None when not held or of another size."""
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
                dst = flat(target)
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

    def stats(self) -> ReadStats:
        holder = None
        if self.store is not None:
            with self._lock:
                holder = self.store.stats()
        with self._count_lock:
            return ReadStats(
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

    # -- the event-loop thread -------------------------------------------------------------------
    async def start(self, ctx: zmq.asyncio.Context, auth: Security) -> str:
        """Serve the holder store (its endpoint; "" without one), expire its orphans, answer status."""
        cfg = self.config
        if self.store is None or cfg.holder_bind is None:
            return ""
        self._server = _LockedStoreServer(self.store, cfg.holder_bind, auth=auth, ctx=ctx, lock=self._lock)
        endpoint = await self._server.start()
        self._tasks.append(asyncio.create_task(self._expire(), name=f"lumen-pages-expire-{cfg.shard}"))
        if cfg.status_bind is not None:
            self._tasks.append(self._start_status(ctx, cfg.status_bind))
        return endpoint

    async def stop_tasks(self) -> None:
        """Stop expiring orphans and answering status."""
        for task in self._tasks:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._tasks.clear()

    async def close(self) -> None:
        """Close the store server (after `stop_tasks`)."""
        if self._server is not None:
            await self._server.close()

    def _start_status(self, ctx: zmq.asyncio.Context, bind: str) -> asyncio.Task[None]:
        """Bind the status socket and serve it. An ipc:// socket must be in a directory only this user
        may write (the runtime directory, made 0700; issue 29), and a socket that cannot be bound is
        an error the server stops on: a warning let another user's socket answer the agent."""
        path: Path | None = None
        if bind.startswith("ipc://"):
            path = Path(bind.removeprefix("ipc://"))
            _own_socket_dir(path.parent)
        sock = ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, 1 << 16)  # a request is a few bytes
        try:
            sock.bind(bind)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise RuntimeError(
                f"holder status socket {bind[:200]} (shard {self.config.shard}) cannot be bound: {exc}"
            ) from exc
        self.status_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if path is not None:
            # what the store holds is the cluster's business only: the socket file is the owner's
            # (the agent runs as the server's user); others may not connect to it
            os.chmod(path, 0o600)
            self._status_inode = os.lstat(path).st_ino
        return asyncio.create_task(
            self._serve_status(sock, path), name=f"lumen-pages-status-{self.config.shard}"
        )

    async def _serve_status(self, sock: zmq.asyncio.Socket, path: Path | None) -> None:
        try:
            while True:
                frames = await sock.recv_multipart(copy=True)
                req = hs.decode_request(frames[0]) if len(frames) == 1 else "one frame expected"
                if isinstance(req, str):
                    answer = hs.HolderStatus(error=req, shard=self.config.shard)
                else:
                    answer = self.holder_status(req.max_requests)
                await sock.send(hs.encode(answer), copy=False)
                self.status_answers += 1
        finally:
            sock.close(0)
            if path is not None:  # no socket file of ours left behind (another's, bound since, stays)
                with contextlib.suppress(OSError):
                    if os.lstat(path).st_ino == self._status_inode:
                        os.unlink(path)

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


def _own_socket_dir(directory: Path) -> None:
    """`directory` fit to hold a status socket: the runtime directory is created (0700) and checked
    (gateway.protocol.secrets.private_dir); any other must be this user's and writable by nobody
    else, or another user could put a socket of theirs there first."""
    if directory == runtime_dir():
        private_dir(directory)
        return
    st = os.stat(directory)
    if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RuntimeError(
            f"holder status socket directory {directory} must be this user's and writable by nobody "
            f"else (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}); use the default endpoint "
            "(the user's runtime directory) or a private directory"
        )
