"""The checkpoint store: dedupe, budget, eviction policies, fencing, restore-by-prefix, properties."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gateway.core.costmodel import MODELS
from gateway.protocol.pagekeys import namespace_seed, page_keys
from tests.fixtures.clock import FakeClock
from worker_hooks.kv.eviction import Eviction
from worker_hooks.kv.payload import model_page_nbytes, page_bytes, page_nbytes, pages_payload, verify
from worker_hooks.kv.store import CheckpointStore, HoldResult, IntegrityError

PS = 2  # page size in tokens
PB = 10  # bytes per page


def send(
    store: CheckpointStore,
    rid: str,
    ids: list[int],
    first_page: int,
    n_pages: int,
    *,
    worker: str = "w0",
    inc: int = 1,
    parent: str | None = None,
    nbytes: int = PB,
) -> HoldResult:
    """Pages first_page..first_page+n_pages of `ids` with their synthetic bytes."""
    keys = page_keys(ids, PS)[first_page : first_page + n_pages]
    return store.hold(
        rid,
        src_worker=worker,
        incarnation=inc,
        first_page=first_page,
        page_size=PS,
        token_ids=ids[first_page * PS : (first_page + n_pages) * PS],
        pages=[page_bytes(k, nbytes) for k in keys],
        parent_key=parent,
    )


def seq(start: int, n_pages: int) -> list[int]:
    return list(range(start, start + n_pages * PS))


def test_shared_prefix_is_stored_once_and_release_frees_everything() -> None:
    store = CheckpointStore(10_000)
    system = seq(0, 3)
    a, b = system + seq(100, 2), system + seq(200, 4)
    assert send(store, "a", a, 0, 5).accepted == 5
    r = send(store, "b", b, 0, 7)
    assert (r.accepted, r.deduped) == (7, 3)
    s = store.stats()
    assert (s.pages, s.bytes_used, s.requests, s.tokens_held) == (9, 9 * PB, 2, 12 * PS)
    store.check_integrity()
    assert store.release("a") == 2  # the shared pages stay for b
    assert store.durable_tokens("b") == 7 * PS
    assert store.release("b") == 7
    assert (store.bytes_used, store.stats().pages) == (0, 0)
    store.check_integrity()


def test_pages_stream_in_order_and_gaps_are_ignored() -> None:
    store = CheckpointStore(10_000)
    ids = seq(0, 6)
    send(store, "r", ids, 0, 2)
    send(store, "r", ids, 2, 1)
    assert store.durable_tokens("r") == 3 * PS
    assert send(store, "r", ids, 4, 1).gap  # page 3 never came
    assert store.durable_tokens("r") == 3 * PS
    info = store.chain("r")
    assert info is not None and info.truncated
    assert send(store, "new", ids, 2, 1).gap  # an unknown request cannot start mid-chain
    assert store.chain("new") is None
    store.check_integrity()


def test_durable_deltas_report_changes_once() -> None:
    store = CheckpointStore(10_000)
    send(store, "a", seq(0, 3), 0, 2)
    send(store, "b", seq(50, 3), 0, 1)
    assert store.durable_deltas() == {"a": 2 * PS, "b": PS}
    assert store.durable_deltas() == {}
    send(store, "a", seq(0, 3), 2, 1)
    store.release("b")
    assert store.durable_deltas() == {"a": 3 * PS, "b": 0}


def fill(store: CheckpointStore, clock: FakeClock, sizes: dict[str, int]) -> None:
    for i, (rid, n) in enumerate(sizes.items()):
        clock.t += 1
        send(store, rid, seq(1000 * (i + 1), n), 0, n)


def test_shortest_prefix_first_evicts_the_fewest_durable_tokens_first() -> None:
    clock = FakeClock(1000.0)
    store = CheckpointStore(6 * PB, "shortest_prefix_first", clock=clock)
    fill(store, clock, {"b": 3, "a": 1, "c": 2})
    clock.t += 1
    r = send(store, "d", seq(9000, 2), 0, 1)
    assert (r.accepted, r.evicted) == (1, ("a",))
    r = send(store, "d", seq(9000, 2), 1, 1)
    assert r.evicted == ("c",)
    assert sorted(store.rids()) == ["b", "d"]
    assert store.stats().evicted_requests == 2
    store.check_integrity()


def test_lru_evicts_the_least_recently_touched_request() -> None:
    clock = FakeClock(1000.0)
    store = CheckpointStore(6 * PB, "lru", clock=clock)
    fill(store, clock, {"b": 3, "a": 1, "c": 2})
    clock.t += 1
    assert send(store, "d", seq(9000, 1), 0, 1).evicted == ("b",)
    store.check_integrity()


def test_none_refuses_the_page_and_truncates_the_writer() -> None:
    store = CheckpointStore(3 * PB, "none")
    ids = seq(0, 5)
    r = send(store, "a", ids, 0, 5)
    assert (r.accepted, r.refused, r.evicted) == (3, 2, ())
    info = store.chain("a")
    assert info is not None and info.truncated and info.durable_tokens == 3 * PS
    assert not store.can_hold(1)
    assert store.stats().refused_pages == 2


def test_the_writer_is_never_evicted_and_others_are_not_destroyed_in_vain() -> None:
    store = CheckpointStore(6 * PB, "shortest_prefix_first")
    ids = seq(0, 8)
    send(store, "prefix-of-a", ids, 0, 2)
    send(store, "a", ids, 0, 6)
    r = send(store, "a", ids, 6, 2)
    # dropping "prefix-of-a" frees nothing (its pages are a's), so the page is refused instead
    assert (r.accepted, r.refused, r.evicted) == (0, 2, ())
    assert sorted(store.rids()) == ["a", "prefix-of-a"]
    assert not store.can_hold(PB, "a") and store.can_hold(PB)  # a newcomer could evict both
    store.check_integrity()


def test_can_hold_counts_what_eviction_may_free() -> None:
    store = CheckpointStore(4 * PB, "lru")
    send(store, "a", seq(0, 3), 0, 3)
    send(store, "b", seq(100, 1), 0, 1)
    assert store.can_hold(PB, "a")  # evicting b makes room
    assert not store.can_hold(2 * PB, "a")  # a's own 3 pages + 2 > 4
    assert not CheckpointStore(4 * PB, "none").can_hold(5 * PB)


def test_stale_incarnation_is_ignored_and_a_newer_one_replaces() -> None:
    store = CheckpointStore(10_000)
    ids = seq(0, 4)
    send(store, "r", ids, 0, 2, inc=2)
    assert send(store, "r", ids, 2, 1, inc=1).stale
    assert store.release("r", src_worker="w0", incarnation=1) == 0  # a late DROP of the old one
    assert store.durable_tokens("r") == 2 * PS
    send(store, "r", ids, 0, 1, inc=3)  # the worker restarted: its new stream replaces the old
    info = store.chain("r")
    assert info is not None and (info.incarnation, info.pages) == (3, 1)
    assert send(store, "other", seq(50, 1), 0, 1, inc=2).stale  # fencing is per worker
    store.check_integrity()


def test_a_new_owner_adopts_the_held_prefix_when_continuing_mid_request() -> None:
    store = CheckpointStore(10_000)
    ids = seq(0, 6)
    keys = page_keys(ids, PS)
    send(store, "r", ids, 0, 3, worker="w0")
    # w0 died; w1 restored pages 0..2 from this holder and streams on from page 3
    r = send(store, "r", ids, 3, 2, worker="w1", parent=keys[2])
    assert r.accepted == 2
    info = store.chain("r")
    assert info is not None and (info.src_worker, info.pages) == ("w1", 5)
    assert send(store, "x", ids, 3, 1, worker="w2", parent=keys[1]).gap  # parent is page 1, not 2
    assert send(store, "r", ids, 3, 1, worker="w0").gap  # a late page of the old owner changes nothing
    info = store.chain("r")
    assert info is not None and (info.src_worker, info.pages) == ("w1", 5)
    store.check_integrity()


def test_longest_prefix_restores_the_held_pages_byte_for_byte() -> None:
    store = CheckpointStore(10_000)
    ids = seq(0, 5)
    send(store, "r", ids, 0, 3)
    n, data = store.longest_prefix([*ids[: 4 * PS], 99, 98, 97], PS)
    assert n == 3 * PS
    assert all(verify(k, d) for k, d in zip(page_keys(ids, PS), data, strict=False))
    assert store.longest_prefix([5, *ids[1:]], PS) == (0, [])
    seed = namespace_seed("tenant", None)
    _, payload = pages_payload(ids, PS, PB, prior=seed)
    pages = [payload[i * PB : (i + 1) * PB] for i in range(5)]
    store.hold(
        "t",
        src_worker="w0",
        incarnation=1,
        first_page=0,
        page_size=PS,
        token_ids=ids,
        pages=pages,
        parent_key=seed,
    )
    assert store.longest_prefix(ids, PS, prior=seed)[0] == 5 * PS
    assert store.longest_prefix(ids, PS)[0] == 3 * PS


def test_orphans_expire_after_the_ttl() -> None:
    clock = FakeClock(1000.0)
    store = CheckpointStore(10_000, orphan_ttl_s=5, clock=clock)
    send(store, "old", seq(0, 1), 0, 1)
    clock.t += 4
    send(store, "new", seq(100, 1), 0, 1)
    clock.t += 2
    assert store.expire_orphans() == ["old"]
    assert store.expire_orphans(clock.t + 10) == ["new"]
    assert store.stats().expired_requests == 2 and store.bytes_used == 0


def test_integrity_check_raises_with_numbers() -> None:
    store = CheckpointStore(10_000)
    send(store, "r", seq(0, 2), 0, 2)
    store._pages.bytes_used += 3
    with pytest.raises(IntegrityError, match=r"pages hold 20 B but bytes_used is 23"):
        store.check_integrity()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        CheckpointStore(-1)
    with pytest.raises(ValueError):
        CheckpointStore(10, "fifo")
    store = CheckpointStore(100)
    with pytest.raises(ValueError):
        store.hold("r", src_worker="w", incarnation=0, first_page=0, page_size=2, token_ids=[1], pages=[b"x"])


def test_synthetic_payload_is_deterministic_and_sized_by_the_cost_model() -> None:
    assert page_nbytes(16, 1024, 0.5) == 8192
    assert model_page_nbytes(MODELS["Qwen3-8B"], 64) == 64 * 144 * 1024
    keys, payload = pages_payload(seq(0, 3), PS, 33)
    assert len(payload) == 99 and payload[:33] == page_bytes(keys[0], 33)
    assert verify(keys[1], payload[33:66]) and not verify(keys[0], payload[33:66])
    with pytest.raises(ValueError):
        page_nbytes(0, 1)


# -- properties -----------------------------------------------------------------------------------
WORKERS = ("w0", "w1")
SYSTEMS = (seq(0, 3), seq(500, 2), [])
REQUESTS = [(f"r{i}", WORKERS[i % 2], SYSTEMS[i % 3] + seq(10_000 + 100 * i, 3 + i % 4)) for i in range(8)]


def nbytes_of(key: str) -> int:
    return 8 + int(key[:2], 16) % 9  # page sizes vary, and agree for equal keys


class StoreMachine(RuleBasedStateMachine):
    """Random hold/release/restart/expire over requests sharing prefixes, checked against the store's
    own invariants and a model of what each request sent."""

    @initialize(policy=st.sampled_from(list(Eviction)), budget=st.integers(0, 40 * 16))
    def start(self, policy: Eviction, budget: int) -> None:
        self.clock = FakeClock(1000.0)
        self.store = CheckpointStore(budget, policy, orphan_ttl_s=10, clock=self.clock)
        self.next_page = {rid: 0 for rid, _, _ in REQUESTS}
        self.inc = dict.fromkeys(WORKERS, 1)
        self.seen = dict.fromkeys(WORKERS, 0)  # newest incarnation the store has heard from

    def _send(self, i: int, n: int, inc: int) -> HoldResult:
        rid, worker, ids = REQUESTS[i]
        first = self.next_page[rid]
        keys = page_keys(ids, PS)[first : first + n]
        return self.store.hold(
            rid,
            src_worker=worker,
            incarnation=inc,
            first_page=first,
            page_size=PS,
            token_ids=ids[first * PS : (first + len(keys)) * PS],
            pages=[page_bytes(k, nbytes_of(k)) for k in keys],
        )

    @rule(i=st.integers(0, len(REQUESTS) - 1), n=st.integers(1, 3))
    def hold(self, i: int, n: int) -> None:
        rid, worker, ids = REQUESTS[i]
        n = min(n, len(ids) // PS - self.next_page[rid])
        if n <= 0:
            return
        self.clock.t += 0.5
        result = self._send(i, n, self.inc[worker])
        assert not result.stale
        self.seen[worker] = self.inc[worker]
        self.next_page[rid] += n  # the sender moves on whatever the holder did

    @precondition(lambda self: any(n > 1 for n in self.seen.values()))
    @rule(i=st.integers(0, len(REQUESTS) - 1))
    def stale_message(self, i: int) -> None:
        rid, worker, ids = REQUESTS[i]
        if self.seen[worker] > 1 and self.next_page[rid] < len(ids) // PS:
            before = self.store.stats().bytes_used
            assert self._send(i, 1, self.seen[worker] - 1).stale
            assert self.store.stats().bytes_used == before

    @rule(i=st.integers(0, len(REQUESTS) - 1))
    def release(self, i: int) -> None:
        rid = REQUESTS[i][0]
        self.store.release(rid)
        self.next_page[rid] = 0

    @rule(w=st.sampled_from(WORKERS))
    def restart(self, w: str) -> None:
        self.inc[w] += 1
        for rid, worker, _ in REQUESTS:
            if worker == w:
                self.next_page[rid] = 0

    @rule(dt=st.floats(0, 15))
    def expire(self, dt: float) -> None:
        self.clock.t += dt
        self.store.expire_orphans()  # the senders do not know and stream on: gaps from here

    @invariant()
    def within_budget_and_consistent(self) -> None:
        assert self.store.bytes_used <= self.store.budget_bytes
        self.store.check_integrity()

    @invariant()
    def held_chains_restore_exactly(self) -> None:
        for rid, _, ids in REQUESTS:
            held = self.store.durable_tokens(rid)
            n, data = self.store.longest_prefix(ids, PS)
            assert n >= held
            keys = page_keys(ids, PS)
            assert all(verify(k, d) for k, d in zip(keys, data, strict=False))

    def teardown(self) -> None:
        for rid in list(self.store.rids()):
            self.store.release(rid)
        s = self.store.stats()
        assert (s.bytes_used, s.pages, s.requests, s.tokens_held) == (0, 0, 0, 0)


StoreMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestStoreMachine = StoreMachine.TestCase
