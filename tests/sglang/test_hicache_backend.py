"""Lumen's HiCache storage backend inside SGLang's own code (sglang 0.5.23, on CPU).

SGLang's `ServerArgs` parses the flags docs/sglang.md gives, its `StorageBackendFactory` builds the
backend from them, its native hasher names the pages, and two "servers" (backends with the storage
configs SGLang gives their ranks) checkpoint and restore pages over Lumen's real KV plane (ZMQ on
loopback). What SGLang cannot do without CUDA (its host KV pools, the cache controller's threads) is
played by tests/sglang/host_pools.py and by calling the backend as `cache_controller.py` does.
"""

from __future__ import annotations

import argparse
import ast
import copy
import importlib.util
import json
import random
import re
import shlex
import time
from array import array
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str, get_storage_hash_str
from sglang.srt.server_args import ServerArgs

from gateway.protocol.pagekeys import namespace_seed, page_keys
from tests.sglang.host_pools import MhaPageFirstPool, MlaPageFirstPool, fill_random, page_bytes
from worker_hooks.sglang.hicache_backend import LumenHiCacheStorage, live_backends
from worker_hooks.sglang.page_routes import RequestRoutes
from worker_hooks.sglang.storage_layout import shard_endpoint

REPO = Path(__file__).resolve().parents[2]
PS = 16
U32 = 1 << 32


def wait_until(cond: Callable[[], bool], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.002)


def documented_launch_args() -> list[str]:
    """The `launch_server` arguments of docs/sglang.md's "Storage backend (part 2)" block."""
    doc = (REPO / "docs" / "sglang.md").read_text()
    section = doc.split("## Storage backend (part 2)", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert block, "docs/sglang.md: no bash block in the storage backend section"
    argv = shlex.split(block.group(1).replace("\\\n", " "))
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    return argv[3:]


def documented_extra_config() -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(documented_launch_args())
    assert args.enable_hierarchical_cache and args.hicache_storage_backend == "dynamic"
    assert args.hicache_write_policy == "write_through"
    assert args.hicache_storage_prefetch_policy == "wait_complete"
    extra: dict[str, Any] = json.loads(args.hicache_storage_backend_extra_config)
    # what SGLang's controllers take out before the backend sees the dict
    # (hybrid_cache_controller.parse_storage_backend_extra_config)
    for key in ("prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token"):
        extra.pop(key, None)
    extra.pop("hicache_storage_pass_prefix_keys", None)
    return extra


def storage_config(extra: dict[str, Any], *, tp_rank: int = 0, tp_size: int = 1, mla: bool = False) -> Any:
    """What `HiCacheController._generate_storage_config` gives one rank."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="Qwen/Qwen3-8B",
        extra_config=copy.deepcopy(extra),
    )


def with_lumen(extra: dict[str, Any], **lumen: Any) -> dict[str, Any]:
    out = copy.deepcopy(extra)
    out["lumen"] = {**out["lumen"], **lumen}
    return out


@pytest.fixture
def backends() -> Iterator[Callable[..., LumenHiCacheStorage]]:
    """Backends built by SGLang's factory with a host pool registered, as the cache controller does
    (`attach_storage_backend`); closed at teardown."""
    made: list[LumenHiCacheStorage] = []

    def make(extra: dict[str, Any], pool: Any, **cfg: Any) -> LumenHiCacheStorage:
        backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra, **cfg), pool)
        backend.register_mem_pool_host(pool)
        backend.on_host_pools_registered()
        made.append(backend)
        return backend

    yield make
    for b in made:
        b.close()


def refused(backend: LumenHiCacheStorage) -> int:
    holder = backend.lumen_stats().holder
    return holder.refused_pages if holder is not None else 0


def indices(pages: list[int], page_size: int = PS) -> torch.Tensor:
    """Host indices of whole pages, as the cache controller passes them."""
    return torch.cat([torch.arange(p * page_size, (p + 1) * page_size) for p in pages]).to(torch.int64)


# -- loading ------------------------------------------------------------------------------------------
def test_sglang_builds_the_backend_from_the_documented_flags(
    backends: Callable[..., LumenHiCacheStorage],
) -> None:
    extra = documented_extra_config()
    assert (extra["backend_name"], extra["module_path"], extra["class_name"]) == (
        "lumen",
        "worker_hooks.sglang.hicache_backend",
        "LumenHiCacheStorage",
    )
    # the cache controller's test for the zero-copy interface (attach_storage_backend)
    assert bool(extra.get("interface_v1", 0))
    local = with_lumen(extra, holder_endpoint="tcp://127.0.0.1:0")
    pool = MhaPageFirstPool(8, PS)
    backend = backends(local, pool)
    assert isinstance(backend, LumenHiCacheStorage) and isinstance(backend, HiCacheStorage)
    assert backend in live_backends() and backend.mem_pool_host is pool
    assert backend.routes is not None and backend.routes.page_size == PS
    assert backend.holder_endpoint.startswith("tcp://127.0.0.1:")
    assert backend.page_store.config.budget_bytes == extra["lumen"]["holder_budget_bytes"]
    assert backend.get_stats() is None  # SGLang substitutes its own empty StorageMetrics


def test_a_bad_lumen_option_fails_the_attach_with_its_name() -> None:
    extra = with_lumen(documented_extra_config(), holder_budget=1)
    with pytest.raises(ValueError, match=r"bad lumen storage option.*holder_budget"):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra), None)
    extra = documented_extra_config()
    del extra["lumen"]
    with pytest.raises(ValueError, match='needs a "lumen" object'):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra), None)


def test_the_host_pool_methods_used_exist_in_sglangs_host_kv_cache() -> None:
    """The doubles in host_pools.py and the backend use HostKVCache's page methods as SGLang declares them."""
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.submodule_search_locations
    base = Path(next(iter(spec.submodule_search_locations))) / "srt" / "mem_cache" / "pool_host" / "base.py"
    tree = ast.parse(base.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "HostKVCache")
    methods = {f.name: [a.arg for a in f.args.args] for f in cls.body if isinstance(f, ast.FunctionDef)}
    assert methods["get_data_page"] == ["self", "index", "flat"]
    assert methods["get_dummy_flat_data_page"] == ["self"]
    assert methods["set_from_flat_data_page"] == ["self", "index", "data_page"]


# -- keys -----------------------------------------------------------------------------------------------
class _Key:
    """What SGLang hashes for storage: a RadixKey's token ids and namespace (`mem_cache/radix_cache.py`,
    whose module needs more of SGLang than this lane installs)."""

    def __init__(self, ids: list[int], extra_key: str | None, cache_salt: str | None) -> None:
        self.token_ids = array("q", ids)
        self.extra_key = extra_key
        self.cache_salt = cache_salt

    def __len__(self) -> int:
        return len(self.token_ids)


def test_lumen_page_keys_are_sglangs_page_hashes() -> None:
    rng = random.Random(1414)
    namespaces = [None, "", "lora-a", "tenant/ü", "x" * 300]
    for case in range(300):
        ps = rng.choice([1, 2, 16, 64])
        n = rng.randrange(0, 6 * ps + 3)
        wide = case % 3 == 0
        ids = [rng.randrange(0, U32) for _ in range(n)]
        if wide and ids:  # ids above 2^32 - 1: SGLang's 0xff marker and uint64 encoding for that page
            for _ in range(rng.randrange(1, 4)):
                ids[rng.randrange(n)] = rng.randrange(U32, 1 << 63)
        extra_key, salt = rng.choice(namespaces), rng.choice(namespaces)
        theirs = get_storage_hash_str(_Key(ids, extra_key, salt), None, page_size=ps)
        ours = page_keys(ids, ps, namespace_seed(extra_key, salt))
        # SGLang's hasher also names a trailing partial page; storage only ever sees page-aligned
        # keys (`RadixKey.page_aligned` in unified_radix_cache.prefetch_from_storage), Lumen only full pages
        assert ours == theirs[: n // ps], (case, ps, n, extra_key, salt)
        aligned = ids[: n // ps * ps]
        assert page_keys(aligned, ps, namespace_seed(extra_key, salt)) == get_storage_hash_str(
            _Key(aligned, extra_key, salt), None, page_size=ps
        )
        # a continuation from a prior key, as SGLang hashes a node under its parent
        if len(ours) >= 2:
            cut = rng.randrange(1, len(ours))
            assert ours[cut:] == get_hash_str(aligned[cut * ps :], ours[cut - 1], page_size=ps)
        # the routing table names the same keys
        assert RequestRoutes(ps).admit("r", ids, [], prior=namespace_seed(extra_key, salt)) == ours


# -- checkpoint on one server, restore on another -------------------------------------------------------
def test_pages_written_by_one_server_are_restored_bit_exact_by_its_holder(
    backends: Callable[..., LumenHiCacheStorage],
) -> None:
    extra = documented_extra_config()
    holder_pool, writer_pool = MhaPageFirstPool(16, PS), MhaPageFirstPool(16, PS)
    holder = backends(with_lumen(extra, worker_id="b", holder_endpoint="tcp://127.0.0.1:0"), holder_pool)
    writer = backends(with_lumen(extra, worker_id="a", holder_endpoint=None), writer_pool)
    fill_random(writer_pool, 7)
    ids = list(range(1000, 1000 + 6 * PS + 5))
    assert writer.routes is not None
    keys = writer.routes.admit("req-1", ids, [holder.holder_endpoint])  # what the plugin does from kv_hints
    assert keys == get_hash_str(ids[: 6 * PS], None, page_size=PS)
    src = [3, 0, 9, 4, 12, 5]  # where the writer's host pool holds pages 0..5
    # the cache controller's backup thread: one radix node after prefill, another later
    assert writer.batch_set_v1(keys[:4], indices(src[:4]), HiCacheStorageExtraInfo()) == [True] * 4
    assert writer.batch_set_v1(keys[4:], indices(src[4:])) == [True] * 2
    # the restoring server: storage hit query, then the prefetch into its own host pool
    wait_until(lambda: holder.batch_exists(keys, HiCacheStorageExtraInfo()) == 6)
    dst = [1, 2, 3, 11, 13, 15]
    assert holder.batch_get_v1(keys, indices(dst)) == [True] * 6
    for s, d in zip(src, dst, strict=True):
        assert page_bytes(holder_pool, d * PS) == page_bytes(writer_pool, s * PS)
    # the tensor-per-page interface reads the same bytes
    got = holder.batch_get(keys[:2], [holder_pool.get_dummy_flat_data_page() for _ in range(2)])
    assert [g.view(torch.uint8).numpy().tobytes() for g in got] == [
        page_bytes(writer_pool, s * PS) for s in src[:2]
    ]
    # a key held by no one: a miss, and the batch stops there
    assert holder.batch_exists([keys[0], "ab" * 32, keys[2]]) == 1
    assert holder.batch_get_v1(["ab" * 32, keys[1]], indices([6, 7])) == [False, False]
    stats = writer.lumen_stats()
    assert (stats.set_pages, stats.queued_pages, stats.dropped_pages) == (6, 6, 0)
    # the request ends (the plugin's call): no more routing, its holder frees its pages
    writer.finish_request("req-1")
    assert writer.routes.rids() == ()
    wait_until(lambda: holder.batch_exists(keys) == 0)


def test_tensor_per_page_interface_round_trip(backends: Callable[..., LumenHiCacheStorage]) -> None:
    extra = documented_extra_config()
    extra["interface_v1"] = 0  # the generic path: batch_set of tensors, batch_get into dummy pages
    holder_pool, writer_pool = MhaPageFirstPool(4, PS), MhaPageFirstPool(4, PS)
    holder = backends(with_lumen(extra, worker_id="b", holder_endpoint="tcp://127.0.0.1:0"), holder_pool)
    writer = backends(with_lumen(extra, worker_id="a", holder_endpoint=None), writer_pool)
    fill_random(writer_pool, 11)
    ids = list(range(2 * PS))
    assert writer.routes is not None
    keys = writer.routes.admit("r", ids, [holder.holder_endpoint])
    data = [writer_pool.get_data_page(p * PS) for p in (2, 1)]  # `_generic_page_set`
    assert writer.batch_set(keys, data) is True
    wait_until(lambda: holder.exists(keys[1]))
    got = holder.batch_get(keys, [holder_pool.get_dummy_flat_data_page() for _ in keys])
    assert all(torch.equal(g, d) for g, d in zip(got, data, strict=True))
    assert holder.get("cd" * 32, holder_pool.get_dummy_flat_data_page()) is None


def test_tp_ranks_are_separate_shards(backends: Callable[..., LumenHiCacheStorage], tmp_path: Path) -> None:
    """TP=2 on both servers: every rank writes its own bytes under the same key, and each holder rank
    serves only its own shard."""
    extra = documented_extra_config()
    base = f"ipc://{tmp_path}/b.sock"
    holders, writers, pools = [], [], []
    for r in (0, 1):
        hp, wp = MhaPageFirstPool(4, PS), MhaPageFirstPool(4, PS)
        fill_random(wp, 100 + r)
        holders.append(
            backends(with_lumen(extra, worker_id="b", holder_endpoint=base), hp, tp_rank=r, tp_size=2)
        )
        writers.append(
            backends(with_lumen(extra, worker_id="a", holder_endpoint=None), wp, tp_rank=r, tp_size=2)
        )
        pools.append((hp, wp))
    assert [h.holder_endpoint for h in holders] == [base, shard_endpoint(base, 1)]
    ids = list(range(500, 500 + 3 * PS))
    for r in (0, 1):
        keys = writers[r].routes.admit("r", ids, [base])  # type: ignore[union-attr]
        assert writers[r].batch_set_v1(keys, indices([0, 1, 2])) == [True] * 3
    for r in (0, 1):
        wait_until(lambda r=r: holders[r].batch_exists(keys) == 3)  # type: ignore[misc]
        hp, wp = pools[r]
        assert holders[r].batch_get_v1(keys, indices([3, 2, 1])) == [True] * 3
        assert [page_bytes(hp, p * PS) for p in (3, 2, 1)] == [page_bytes(wp, p * PS) for p in (0, 1, 2)]
    assert page_bytes(pools[0][0], 3 * PS) != page_bytes(pools[1][0], 3 * PS)


def test_mla_pages_reach_every_holder_rank_and_move_in_place(
    backends: Callable[..., LumenHiCacheStorage], tmp_path: Path
) -> None:
    """A rank-replicated (MLA) cache: SGLang lets only rank 0 write (`is_storage_writer`); each TP rank
    of the holder gets the page in its own store and reads it straight into its pool's page (a
    contiguous page needs no staging copy)."""
    extra = documented_extra_config()
    base = f"ipc://{tmp_path}/mla.sock"
    wp = MlaPageFirstPool(4, PS)
    fill_random(wp, 5)
    holder_pools = [MlaPageFirstPool(4, PS) for _ in range(2)]
    holders = [
        backends(
            with_lumen(extra, worker_id="b", holder_endpoint=base),
            holder_pools[r],
            tp_rank=r,
            tp_size=2,
            mla=True,
        )
        for r in (0, 1)
    ]
    writers = [
        backends(with_lumen(extra, worker_id="a", holder_endpoint=None), wp, tp_rank=r, tp_size=2, mla=True)
        for r in (0, 1)
    ]
    assert [w.storage_config.is_storage_writer for w in writers] == [True, False]
    keys = writers[0].routes.admit("r", list(range(2 * PS)), [base])  # type: ignore[union-attr]
    assert writers[0].batch_set_v1(keys, indices([2, 3])) == [True, True]
    for r in (0, 1):
        wait_until(lambda r=r: holders[r].batch_exists(keys) == 2)  # type: ignore[misc]
        assert holders[r].batch_get_v1(keys, indices([0, 1])) == [True, True]
        assert holder_pools[r].kv_buffer[: 2 * PS].view(torch.uint8).numpy().tobytes() == (
            wp.kv_buffer[2 * PS :].view(torch.uint8).numpy().tobytes()
        )


# -- degradation ----------------------------------------------------------------------------------------
def test_a_dead_holder_degrades_without_blocking(backends: Callable[..., LumenHiCacheStorage]) -> None:
    extra = with_lumen(documented_extra_config(), worker_id="a", holder_endpoint=None, max_lag_bytes=16 << 10)
    pool = MhaPageFirstPool(32, PS)
    writer = backends(extra, pool)
    ids = list(range(32 * PS))
    keys = writer.routes.admit("r", ids, ["tcp://127.0.0.1:9"])  # type: ignore[union-attr]
    worst, results = 0.0, []
    for i in range(0, 32, 8):
        t0 = time.perf_counter()
        results += writer.batch_set_v1(keys[i : i + 8], indices(list(range(i, i + 8))))
        worst = max(worst, time.perf_counter() - t0)
    wait_until(lambda: writer.lumen_stats().abandoned == 1)
    again = writer.batch_set_v1(keys[:8], indices(list(range(8))))
    assert worst < 0.25 and again == [False] * 8 and writer.lumen_stats().dropped_pages >= 8
    t0 = time.perf_counter()
    writer.close()
    assert time.perf_counter() - t0 < 2.0


def test_a_full_holder_budget_holds_a_prefix_and_refuses_the_rest(
    backends: Callable[..., LumenHiCacheStorage],
) -> None:
    extra = documented_extra_config()
    wp, hp = MhaPageFirstPool(8, PS), MhaPageFirstPool(8, PS)
    page_nbytes = len(page_bytes(wp, 0))
    holder = backends(
        with_lumen(
            extra,
            worker_id="b",
            holder_endpoint="tcp://127.0.0.1:0",
            holder_budget_bytes=3 * page_nbytes,
            eviction="none",
        ),
        hp,
    )
    writer = backends(with_lumen(extra, worker_id="a", holder_endpoint=None), wp)
    keys = writer.routes.admit("r", list(range(8 * PS)), [holder.holder_endpoint])  # type: ignore[union-attr]
    t0 = time.perf_counter()
    assert writer.batch_set_v1(keys, indices(list(range(8)))) == [True] * 8
    assert time.perf_counter() - t0 < 0.25
    wait_until(lambda: refused(holder) == 5)
    stats = holder.lumen_stats().holder
    assert stats is not None and stats.bytes_used == 3 * page_nbytes <= stats.budget_bytes
    assert holder.batch_exists(keys) == 3
    assert holder.batch_get_v1(keys, indices(list(range(8)))) == [True] * 3 + [False] * 5
