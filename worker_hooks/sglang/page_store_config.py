"""What one rank's page store is set up with (`PageStoreConfig`, from the storage backend's options) and
what it reports (`PageStoreStats`); shared by the store (page_store.py) and its parts (page_writer.py,
local_holder.py)."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.protocol.launch import Eviction
from worker_hooks.kv.store import StoreStats
from worker_hooks.sglang.storage_layout import (
    LumenStorageOptions,
    ShardLayout,
    shard_endpoint,
    status_endpoint_for,
)


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
