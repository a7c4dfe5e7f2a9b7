"""Lumen as an SGLang HiCache storage backend (sglang 0.5.23): SGLang loads this module itself.

    python -m sglang.launch_server ... --enable-hierarchical-cache --page-size 64 \\
      --hicache-write-policy write_through --hicache-storage-prefetch-policy wait_complete \\
      --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{
        "backend_name": "lumen", "module_path": "worker_hooks.sglang.hicache_backend",
        "class_name": "LumenHiCacheStorage", "interface_v1": 1, "prefetch_threshold": 64,
        "lumen": {"worker_id": "sgl-0", "holder_endpoint": "tcp://10.0.0.1:5600",
                  "holder_budget_bytes": 8589934592}}'

SGLang's `StorageBackendFactory._create_dynamic_backend` imports `module_path`, checks the class
subclasses `HiCacheStorage` and builds it as `cls(storage_config, kwargs)`; the cache controller then
calls `register_mem_pool_host(host_pool)` and, with `"interface_v1": 1`, moves pages with
`batch_get_v1` / `batch_set_v1` (host pool indices) instead of the tensor-per-page `batch_get` /
`batch_set` (`srt/managers/cache_controller.py`). Everything else is `page_store.PageStore`: this class
only turns tensors and host-pool pages into bytes and back. It and SGLang's plugin are the only Lumen
modules that import sglang (and torch, which sglang needs anyway).

Host-pool pages: `get_data_page(index, flat=False)` is a view of the pool; where that view is contiguous
(e.g. an MLA pool in page_first layout) its bytes are read or written in place, else SGLang's own
`get_data_page(index, flat=True)` / `set_from_flat_data_page` copy through a staging page. Either way a
write costs one more copy (into the KV plane's send buffer, which must own the bytes once SGLang frees
the host page) and a read one copy out of the holder store. A page held with another byte size than
this server's pages (another model, dtype, TP layout or page size) is a miss, never a wrong load.

Not supported (refused at construction): decode context parallel (`dcp_size > 1`) and heterogeneous-TP
head splitting (`tp_lcm_size`). The v2 pool interface (hybrid Mamba/SWA models) is not implemented:
SGLang raises NotImplementedError for it, as for any backend without it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from worker_hooks.sglang.page_routes import PageRoute, RequestRoutes, RouteLookup
from worker_hooks.sglang.page_store import PageStore
from worker_hooks.sglang.page_store_config import PageStoreConfig, PageStoreStats
from worker_hooks.sglang.storage_layout import load_route_provider, options_from_extra_config, shard_layout

_live: weakref.WeakSet[LumenHiCacheStorage] = weakref.WeakSet()
_live_lock = threading.Lock()


def live_backends() -> list[LumenHiCacheStorage]:
    """The backends open in this process (one per SGLang scheduler rank): how a plugin in the same
    process finds the `routes` table it fills."""
    with _live_lock:
        return list(_live)


def _bytes_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return t.reshape(-1).view(torch.uint8).numpy().data


class LumenHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        if storage_config.dcp_size > 1:
            raise ValueError("Lumen's HiCache backend does not support decode context parallelism")
        if storage_config.tp_lcm_size or storage_config.should_split_heads:
            raise ValueError("Lumen's HiCache backend does not support tp_lcm_size (head splitting)")
        opts = options_from_extra_config(storage_config.extra_config)
        self.shards = shard_layout(
            tp_rank=storage_config.tp_rank,
            tp_size=storage_config.tp_size,
            pp_rank=storage_config.pp_rank,
            pp_size=storage_config.pp_size,
            cp_rank=storage_config.attn_cp_rank,
            cp_size=storage_config.attn_cp_size,
            rank_replicated=storage_config.is_mla_model,
        )
        self.storage_config = storage_config
        # the plugin's table, or this backend's own one (its page size is the host pool's, known at
        # register_mem_pool_host; until then nothing is routed)
        self._provider: RouteLookup | None = (
            load_route_provider(opts.route_provider) if opts.route_provider else None
        )
        self.routes: RequestRoutes | None = None
        self.mem_pool_host: Any = None
        self.page_store = PageStore(PageStoreConfig.for_rank(opts, self.shards), self._route)
        with _live_lock:
            _live.add(self)

    def _route(self, key: str) -> Sequence[PageRoute]:
        if self._provider is not None:
            return self._provider(key)
        return self.routes(key) if self.routes is not None else ()

    # -- the plugin's side: requests end ----------------------------------------------------------
    def finish_request(self, rid: str) -> None:
        """Request `rid` ended: no more routing, its holders free its pages once the queued ones went
        out (END)."""
        if self.routes is not None:
            self.routes.retire(rid)
        self.page_store.finish(rid)

    def drop_request(self, rid: str) -> None:
        """The gateway dropped `rid`'s checkpoint: queued pages discarded, DROP at its holders."""
        if self.routes is not None:
            self.routes.retire(rid)
        self.page_store.drop(rid)

    @property
    def holder_endpoint(self) -> str:
        """Where this rank's holder store listens ("" without one)."""
        return self.page_store.endpoint

    # -- host pool ---------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        if self._provider is None and self.routes is None:
            self.routes = RequestRoutes(int(mem_pool_host.page_size))

    def _host_page_in_place(self, index: int) -> torch.Tensor | None:
        page = self.mem_pool_host.get_data_page(index, flat=False)
        return page if page.is_contiguous() and page.device.type == "cpu" else None

    # -- zero-copy interface (interface_v1) ----------------------------------------------------------
    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        pool = self.mem_pool_host
        ps = int(pool.page_size)
        results = [False] * len(keys)
        for i, key in enumerate(keys):
            index = int(host_indices[i * ps])
            page = self._host_page_in_place(index)
            if page is not None:
                results[i] = self.page_store.get(key, _bytes_view(page)) is not None
            else:
                staging = pool.get_dummy_flat_data_page()
                results[i] = self.page_store.get(key, _bytes_view(staging)) is not None
                if results[i]:
                    pool.set_from_flat_data_page(index, staging)
            if not results[i]:
                break  # SGLang uses the leading run of hits only
        return results

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        pool = self.mem_pool_host
        ps = int(pool.page_size)
        pages = []
        for i in range(len(keys)):
            index = int(host_indices[i * ps])
            page = self._host_page_in_place(index)
            if page is None:
                page = pool.get_data_page(index, flat=True).contiguous()
            pages.append(_bytes_view(page))
        return self.page_store.batch_set(keys, pages)

    # -- tensor-per-page interface ---------------------------------------------------------------------
    def get(
        self, key: str, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> torch.Tensor | None:
        if target_location is None:
            data = self.page_store.get(key)
            return None if data is None else torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if not target_location.is_contiguous():
            return None
        got = self.page_store.get(key, _bytes_view(target_location))
        return None if got is None else target_location

    def batch_get(
        self, keys: list[str], target_locations: Any | None = None, target_sizes: Any | None = None
    ) -> list[torch.Tensor | None]:
        targets = target_locations if target_locations is not None else [None] * len(keys)
        return [self.get(key, target) for key, target in zip(keys, targets, strict=True)]

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        if value is None:
            return False
        return self.page_store.set(key, _bytes_view(value.contiguous()))

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        if values is None:
            return False
        return all(self.page_store.batch_set(keys, [_bytes_view(v.contiguous()) for v in values]))

    def exists(self, key: str) -> bool:
        return self.page_store.exists(key)

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        return self.page_store.batch_exists(keys)

    # -- lifecycle ---------------------------------------------------------------------------------
    def clear(self) -> None:
        self.page_store.clear()

    def get_stats(self) -> None:
        # SGLang expects its own StorageMetrics here (None: it makes an empty one); Lumen's counters
        # are `lumen_stats()`
        return None

    def lumen_stats(self) -> PageStoreStats:
        return self.page_store.stats()

    def close(self) -> None:
        self.page_store.close()
        with _live_lock:
            _live.discard(self)
