"""Lumen's HiCache page store (worker_hooks/sglang/page_store.py) without SGLang: routing, TP shards,
budgets, degradation, over the real KV plane (ZMQ on loopback), and a stand-in SGLang server that
checkpoints through it while a second one restores from its co-located holder store.

The SGLang subclass around it is tested with the real sglang package in tests/sglang (`./dev sglang-test`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from gateway.protocol.pagekeys import namespace_seed, page_keys
from gateway.protocol.planes import Member, MemberTable, PlaneAuth
from tests.fixtures.sglang_standin import SGLangStandIn, expected_ids, greedy_ids, start_standin
from worker_hooks.kv.payload import page_bytes, verify
from worker_hooks.sglang.page_routes import PageRoute, RequestRoutes
from worker_hooks.sglang.page_store import PageStore
from worker_hooks.sglang.page_store_config import PageStoreConfig
from worker_hooks.sglang.storage_layout import (
    LumenStorageOptions,
    ShardLayout,
    options_from_extra_config,
    shard_endpoint,
    shard_layout,
)

PS = 16
NB = 2048  # bytes per page
LOOPBACK = "tcp://127.0.0.1:0"


def wait_until(cond: Callable[[], bool], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.002)


def tokens(n: int, start: int = 0) -> list[int]:
    return [(start + 7 * i) % 50_000 for i in range(n)]


@pytest.fixture
def stores() -> Iterator[Callable[..., PageStore]]:
    """Page stores closed at teardown, whatever the test did. Each has its own CURVE keys; all are
    members of one table (what the agents' plane files hold), so they trust each other."""
    made: list[PageStore] = []
    members: list[Member] = []
    table = MemberTable()

    def make(routes: Any = None, **cfg: Any) -> PageStore:
        cfg.setdefault("worker_id", f"w{len(made)}")
        auth = PlaneAuth.generate(table)
        config = PageStoreConfig(**cfg)
        store = (
            PageStore(config, routes, auth=auth) if routes is not None else PageStore(config, auth=auth)
        )
        made.append(store)
        members.append(Member(config.worker_id, config.incarnation, auth.keys.public, store.endpoint))
        table.replace(members)
        return store

    yield make
    for s in made:
        s.close()


# -- routing ----------------------------------------------------------------------------------------
def test_routes_follow_a_request_and_its_shared_prefix() -> None:
    routes = RequestRoutes(PS)
    ids = tokens(5 * PS + 3)
    keys = routes.admit("a", ids, ["tcp://h1:1", "tcp://h1:1", "tcp://h2:2"])
    assert keys == page_keys(ids, PS)
    assert routes(keys[0]) == [PageRoute("a", ("tcp://h1:1", "tcp://h2:2"), 0, tuple(ids[:PS]), None)]
    assert routes(keys[3])[0].parent_key == keys[2] and routes(keys[3])[0].page_index == 3
    # the tail page completes later
    more = tokens(PS, 999)
    (k5,) = routes.extend("a", more)
    assert k5 == page_keys(ids + more, PS)[5] and routes(k5)[0].token_ids == tuple(
        (ids + more)[5 * PS : 6 * PS]
    )
    # a second request sharing two pages: both are routed for those pages
    routes.admit("b", ids[: 2 * PS] + tokens(PS, 5), ["tcp://h3:3"])
    assert {r.rid for r in routes(keys[1])} == {"a", "b"} and {r.rid for r in routes(keys[2])} == {"a"}
    routes.set_holders("b", ["tcp://h4:4"])
    assert next(r for r in routes(keys[0]) if r.rid == "b").holders == ("tcp://h4:4",)
    routes.retire("a")
    assert [r.rid for r in routes(keys[0])] == ["b"] and routes(keys[3]) == [] and routes.rids() == ("b",)
    # a namespaced request hashes from its seed: other keys, the seed as page 0's parent
    seed = namespace_seed("tenant", None)
    nk = routes.admit("c", ids, ["tcp://h1:1"], prior=seed)
    assert nk == page_keys(ids, PS, seed) and nk[0] != keys[0] and routes(nk[0])[0].parent_key == seed


def test_shards_and_their_endpoints() -> None:
    assert shard_layout(tp_rank=3, tp_size=4) == ShardLayout(3, (3,), 4)
    assert shard_layout(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2) == ShardLayout(3, (3,), 4)
    assert shard_layout(tp_rank=1, tp_size=2, cp_rank=1, cp_size=2) == ShardLayout(3, (3,), 4)
    # MLA: one writer per stage, every TP rank of the holder needs the page
    assert shard_layout(tp_rank=0, tp_size=4, rank_replicated=True) == ShardLayout(0, (0, 1, 2, 3), 4)
    assert shard_layout(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2, rank_replicated=True).write_to == (2, 3)
    with pytest.raises(ValueError, match="tp rank 4 outside"):
        shard_layout(tp_rank=4, tp_size=4)
    assert shard_endpoint("tcp://10.0.0.1:5600", 0) == "tcp://10.0.0.1:5600"
    assert shard_endpoint("tcp://10.0.0.1:5600", 3) == "tcp://10.0.0.1:5603"
    assert shard_endpoint("ipc:///run/kv.sock", 2) == "ipc:///run/kv.sock.shard2"
    for bad, msg in [("tcp://h:0", "fixed port"), ("tcp://h", "host:port"), ("http://h:1", "unsupported")]:
        with pytest.raises(ValueError, match=msg):
            shard_endpoint(bad, 1)


def test_extra_config_options_are_checked() -> None:
    extra = {
        "backend_name": "lumen",
        "interface_v1": 1,
        "lumen": {"worker_id": "w", "holder_budget_bytes": 8},
    }
    opts = options_from_extra_config(extra)
    assert opts == LumenStorageOptions(worker_id="w", holder_budget_bytes=8)
    cfg = PageStoreConfig.for_rank(
        LumenStorageOptions(worker_id="w", holder_endpoint="tcp://h:100", holder_budget_bytes=10),
        shard_layout(tp_rank=1, tp_size=2),
    )
    assert (cfg.holder_bind, cfg.budget_bytes, cfg.shard, cfg.write_to) == ("tcp://h:101", 5, 1, (1,))
    with pytest.raises(ValueError, match='needs a "lumen" object'):
        options_from_extra_config({"backend_name": "lumen"})
    with pytest.raises(ValueError, match=r"bad lumen storage option.*holder_budget"):
        options_from_extra_config({"lumen": {"worker_id": "w", "holder_budget": 1}})
    with pytest.raises(ValueError, match="unsupported endpoint"):
        options_from_extra_config({"lumen": {"worker_id": "w", "holder_endpoint": "h:1"}})


# -- over the KV plane ------------------------------------------------------------------------------
def pages_of(keys: list[str], salt: int = 0) -> list[bytes]:
    return [page_bytes(k if not salt else f"{salt:016x}{k[16:]}", NB) for k in keys]


def test_pages_written_on_one_worker_are_read_back_from_the_holder(stores: Callable[..., PageStore]) -> None:
    holder = stores(holder_bind=LOOPBACK, budget_bytes=64 * NB)
    routes = RequestRoutes(PS)
    writer = stores(routes)
    ids = tokens(6 * PS + 5)
    keys = routes.admit("r1", ids, [holder.endpoint])
    # SGLang writes a radix node at a time: pages 0-2 after prefill, then 3-5
    assert writer.batch_set(keys[:3], pages_of(keys[:3])) == [True] * 3
    assert writer.batch_set(keys[3:], [memoryview(p) for p in pages_of(keys[3:])]) == [True] * 3
    wait_until(lambda: holder.batch_exists(keys) == 6)
    assert not writer.exists(keys[0])  # a writer reads only its own holder store (none here)
    got = holder.batch_get(keys)
    assert all(verify(k, g) for k, g in zip(keys, got, strict=True))
    targets = [np.zeros(NB, np.uint8) for _ in keys]
    assert holder.batch_get(keys, targets) == targets and all(
        verify(k, t) for k, t in zip(keys, targets, strict=True)
    )
    assert holder.get(keys[0], np.zeros(NB - 1, np.uint8)) is None  # another page size: a miss
    assert holder.batch_exists([keys[0], "0" * 64, keys[2]]) == 1
    chain = holder.store.chain("r1") if holder.store else None
    assert chain is not None and chain.src_worker == "w1" and chain.pages == 6
    s = writer.stats()
    assert (s.set_pages, s.queued_pages, s.unrouted_pages, s.dropped_pages) == (6, 6, 0, 0)
    # the request ends: END frees its pages at the holder
    writer.finish("r1")
    wait_until(lambda: holder.batch_exists(keys) == 0)


def test_unrouted_pages_are_not_sent(stores: Callable[..., PageStore]) -> None:
    holder = stores(holder_bind=LOOPBACK, budget_bytes=64 * NB)
    writer = stores(RequestRoutes(PS))
    keys = page_keys(tokens(3 * PS), PS)
    assert writer.batch_set(keys, pages_of(keys)) == [True] * 3
    # a request the gateway gave no holder is not checkpointed either
    routes = RequestRoutes(PS)
    keys2 = routes.admit("no-holder", tokens(2 * PS, 1), [])
    assert stores(routes).batch_set(keys2, pages_of(keys2)) == [True] * 2
    assert writer.flush(2.0)
    s = writer.stats()
    assert (s.unrouted_pages, s.queued_pages) == (3, 0) and holder.batch_exists(keys) == 0


def test_tp_ranks_write_their_own_shard_under_the_same_key(
    stores: Callable[..., PageStore], tmp_path: Path
) -> None:
    base = f"ipc://{tmp_path}/holder.sock"
    holders = [stores(holder_bind=shard_endpoint(base, r), shard=r, budget_bytes=16 * NB) for r in (0, 1)]
    ids = tokens(3 * PS)
    writers = []
    for r in (0, 1):  # every rank's scheduler fills its own table with the same request
        routes = RequestRoutes(PS)
        keys = routes.admit("r", ids, [base])
        writers.append(stores(routes, worker_id="w", shard=r))
        assert writers[r].batch_set(keys, pages_of(keys, salt=r + 1)) == [True] * 3
    for r in (0, 1):
        wait_until(lambda r=r: holders[r].batch_exists(keys) == 3)  # type: ignore[misc]
        assert holders[r].batch_get(keys) == pages_of(keys, salt=r + 1)


def test_a_replicated_cache_writes_every_holder_rank(
    stores: Callable[..., PageStore], tmp_path: Path
) -> None:
    base = f"ipc://{tmp_path}/mla.sock"
    holders = [stores(holder_bind=shard_endpoint(base, r), shard=r, budget_bytes=16 * NB) for r in (0, 1)]
    routes = RequestRoutes(PS)
    keys = routes.admit("r", tokens(2 * PS), [base])
    writer = stores(routes, shard=0, write_to=(0, 1))  # SGLang's only storage writer of an MLA cache
    assert writer.batch_set(keys, pages_of(keys)) == [True, True]
    for h in holders:
        wait_until(lambda h=h: h.batch_exists(keys) == 2)  # type: ignore[misc]
        assert h.batch_get(keys) == pages_of(keys)


def test_a_dead_holder_never_blocks_a_write(stores: Callable[..., PageStore]) -> None:
    routes = RequestRoutes(PS)
    dead = "tcp://127.0.0.1:9"  # nothing listens: zmq never connects, the link's queue only grows
    writer = stores(routes, max_lag_bytes=4 * NB, drain_timeout_s=0.05)
    ids = tokens(40 * PS)
    keys = routes.admit("r", ids, [dead])
    worst = 0.0
    results = []
    for i in range(0, 40, 4):
        t0 = time.perf_counter()
        results += writer.batch_set(keys[i : i + 4], pages_of(keys[i : i + 4]))
        worst = max(worst, time.perf_counter() - t0)
    wait_until(lambda: writer.stats().abandoned == 1)
    more = writer.batch_set(keys[:2], pages_of(keys[:2]))
    s = writer.stats()
    assert worst < 0.25 and more == [False, False] and s.dropped_pages >= 2
    assert s.pending_bytes <= 8 * NB
    t0 = time.perf_counter()
    writer.close()
    assert time.perf_counter() - t0 < 2.0


def test_a_full_holder_budget_truncates_the_checkpoint(stores: Callable[..., PageStore]) -> None:
    holder = stores(holder_bind=LOOPBACK, budget_bytes=3 * NB, eviction="none")
    routes = RequestRoutes(PS)
    writer = stores(routes)
    keys = routes.admit("r", tokens(8 * PS), [holder.endpoint])
    t0 = time.perf_counter()
    assert writer.batch_set(keys, pages_of(keys)) == [True] * 8  # the writer cannot know: PUSH is one-way
    assert time.perf_counter() - t0 < 0.25
    wait_until(lambda: holder.stats().holder is not None and holder.stats().holder.refused_pages == 5)  # type: ignore[union-attr]
    hs = holder.stats().holder
    assert hs is not None and hs.bytes_used == 3 * NB == hs.budget_bytes
    assert holder.batch_exists(keys) == 3 and holder.get(keys[3]) is None


def test_a_full_handoff_queue_drops_instead_of_waiting(stores: Callable[..., PageStore]) -> None:
    holder = stores(holder_bind=LOOPBACK, budget_bytes=64 * NB)
    routes = RequestRoutes(PS)
    writer = stores(routes, max_pending_bytes=2 * NB)
    keys = routes.admit("r", tokens(4 * PS), [holder.endpoint])
    assert writer.batch_set(keys, pages_of(keys)) == [False] * 4  # one run of 4 pages > 2 pages
    assert writer.batch_set(keys[:2], pages_of(keys[:2])) == [True] * 2
    wait_until(lambda: holder.batch_exists(keys) == 2)
    assert writer.stats().dropped_pages == 4


def test_a_failing_route_lookup_is_a_miss_not_an_error(stores: Callable[..., PageStore]) -> None:
    def broken(key: str) -> list[PageRoute]:
        raise RuntimeError("filler bug")

    writer = stores(broken)
    keys = page_keys(tokens(PS), PS)
    assert writer.batch_set(keys, pages_of(keys)) == [True] and writer.stats().unrouted_pages == 1


# -- a stand-in SGLang server checkpoints through the page store; a second one restores --------------
class StorageTier:
    """What SGLang's cache controller (and Lumen's plugin filling the routes) does with a backend,
    for the stand-in engine: restore a prompt's prefix by keys, write a sequence's full pages."""

    def __init__(
        self, store: PageStore, routes: RequestRoutes | None = None, holders: tuple[str, ...] = ()
    ) -> None:
        self.store, self.routes, self.holders = store, routes, holders
        self.restored: list[tuple[str, int]] = []

    def restore(self, rid: str, ids: list[int], limit: int) -> int:
        keys = page_keys(ids[:limit], PS)
        hit = self.store.batch_exists(keys)
        pages = self.store.batch_get(keys[:hit])
        good = 0
        for key, page in zip(keys, pages, strict=False):  # bit-exact or not restored
            if page is None or not verify(key, page):
                break
            good += 1
        self.restored.append((rid, good * PS))
        return good * PS

    def backup(self, rid: str, ids: list[int]) -> None:
        if self.routes is not None:
            self.routes.admit(rid, ids, self.holders)  # the plugin: the request's tokens and kv_hints
        keys = page_keys(ids, PS)
        self.store.batch_set(keys, pages_of(keys))


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def until(cond: Callable[[], bool], within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.002)


async def test_a_standin_server_restores_a_prefix_checkpointed_by_another(
    stores: Callable[..., PageStore], http: aiohttp.ClientSession
) -> None:
    holder_store = stores(holder_bind=LOOPBACK, budget_bytes=256 * NB, worker_id="b")
    routes = RequestRoutes(PS)
    writer_store = stores(routes, worker_id="a")
    a: SGLangStandIn = await start_standin(token_delay_ms=2, page_size=PS)
    b: SGLangStandIn = await start_standin(token_delay_ms=1, page_size=PS)
    a.engine.storage = StorageTier(writer_store, routes, (holder_store.endpoint,))
    tier_b = StorageTier(holder_store)
    b.engine.storage = tier_b
    try:
        prompt = list(range(40, 120)) + list(range(60, 75))  # 95 ids: 5 full pages
        total = 40
        request = {"input_ids": prompt, "sampling_params": {"max_new_tokens": total, "temperature": 0}}
        emitted: list[int] = []
        async with http.post(a.url + "/generate", json={**request, "stream": True}) as resp:
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith("data: {"):
                    emitted = json.loads(line[len("data: ") :])["output_ids"]
                    if len(emitted) >= 7:
                        await a.kill()  # the serving worker dies mid-stream
                        break
        assert emitted == greedy_ids(prompt, len(emitted))
        # its prompt pages were checkpointed after prefill (and, if its abort got that far, more)
        assert writer_store.flush(2.0)
        resumed = prompt + emitted
        keys = page_keys(resumed[: len(resumed) - 1], PS)
        await until(lambda: holder_store.batch_exists(keys) >= 5)
        held = holder_store.batch_exists(keys)
        # the gateway resumes on the holder: prompt + emitted ids, fewer new tokens
        resume = {
            "input_ids": resumed,
            "sampling_params": {"max_new_tokens": total - len(emitted), "temperature": 0},
        }
        async with http.post(b.url + "/generate", json=resume) as resp:
            answer = await resp.json()
        # restored from the co-located holder store, bit-exact (StorageTier.restore verifies every page)
        assert answer["meta_info"]["cached_tokens"] == held * PS >= 5 * PS
        assert tier_b.restored == [(answer["meta_info"]["id"], held * PS)]
        assert answer["output_ids"] == expected_ids(resumed, total - len(emitted))
        assert emitted + answer["output_ids"] == greedy_ids(prompt, total)
        # an unrelated prompt restores nothing
        other_req = {"input_ids": tokens(50, 3), "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
        async with http.post(b.url + "/generate", json=other_req) as resp:
            other = await resp.json()
        assert other["meta_info"]["cached_tokens"] == 0 and tier_b.restored[-1][1] == 0
    finally:
        await a.stop()
        await b.stop()
