"""Paged KV accounting and step composition (continuous batching with chunked prefill)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.protocol.generate import SamplingParams
from models.paging import pages_for
from models.synthetic import SyntheticModel, expected_output
from worker_hooks.engine.admission import aged_shortest_first
from worker_hooks.engine.pages import PagePool, PagePoolError
from worker_hooks.engine.scheduler import Emission, Scheduler, StepResult

MODEL = SyntheticModel(0, 32, 127)

# -- the page pool ----------------------------------------------------------------------------------

ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "grow", "free"]),
        st.integers(0, 7),  # owner
        st.integers(0, 12),  # pages
        st.integers(0, 12),  # reserve
    ),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(total=st.integers(1, 40), ops=ops)
def test_pool_never_over_capacity_and_stays_consistent(
    total: int, ops: list[tuple[str, int, int, int]]
) -> None:
    pool = PagePool(total * 4, 4)
    promised: dict[str, int] = {}  # owner -> pages it may hold without drawing on the free pool
    for op, o, n, reserve in ops:
        owner = f"r{o}"
        if op == "alloc":
            ok = owner not in promised and pool.can_allocate(n + reserve)
            if ok:
                assert len(pool.allocate(owner, n, reserve=reserve)) == n
                promised[owner] = n + reserve
            else:
                with pytest.raises(PagePoolError):
                    pool.allocate(owner, n, reserve=reserve)
        elif op == "grow" and owner in promised:
            if n <= promised[owner]:
                pool.grow_to(owner, n)  # inside its reservation: must never fail
                assert pool.owned(owner) >= n
            else:
                try:
                    pool.grow_to(owner, n)
                    promised[owner] = max(promised[owner], n)
                except PagePoolError:
                    pass
        elif op == "free":
            held = pool.owned(owner)
            assert pool.free(owner) == held
            promised.pop(owner, None)
        pool.check_integrity()
        assert 0 <= pool.used_pages <= pool.total_pages
        assert pool.used_pages + pool.free_pages == pool.total_pages
        assert pool.available_pages >= 0
    for owner in list(promised):
        pool.free(owner)
    pool.check_integrity()
    assert pool.used_pages == 0 and pool.available_pages == pool.total_pages


def test_pool_errors_carry_the_numbers() -> None:
    pool = PagePool(40, 4)  # 10 pages
    pool.allocate("a", 2, reserve=6)
    with pytest.raises(
        PagePoolError, match=r"cannot allocate 2\+1 pages: 2 available \(8 free, 6 reserved\)"
    ):
        pool.allocate("b", 2, reserve=1)
    with pytest.raises(PagePoolError, match="already holds 2 pages"):
        pool.allocate("a", 1)
    with pytest.raises(PagePoolError, match="holds no pages"):
        pool.grow_to("nobody", 1)
    assert pool.grow_to("a", 8) == 6  # all from its reservation
    assert pool.available_pages == 2
    with pytest.raises(PagePoolError, match="needs 3 more pages"):
        pool.grow_to("a", 11)


def test_integrity_check_finds_a_leak_and_a_double_owner() -> None:
    pool = PagePool(16, 4)
    pool.allocate("a", 2)
    pool._free.pop()
    with pytest.raises(PagePoolError, match=r"page leak: 2 owned \+ 1 free != 4 total"):
        pool.check_integrity()
    pool = PagePool(16, 4)
    pages = pool.allocate("a", 2)
    pool._free.append(pages[0])
    pool._owners["a"].pages.pop()
    with pytest.raises(PagePoolError, match="page ids corrupt"):
        pool.check_integrity()


def test_pool_rejects_a_capacity_below_one_page() -> None:
    with pytest.raises(ValueError, match="less than one page"):
        PagePool(3, 4)


# -- the scheduler ----------------------------------------------------------------------------------


def make(capacity: int = 4096, page: int = 4, max_running: int = 8, chunk: int = 16) -> Scheduler:
    return Scheduler(MODEL, PagePool(capacity, page), max_running=max_running, chunked_prefill_size=chunk)


def add(s: Scheduler, rid: str, prompt_len: int, max_new: int, **kw: object) -> None:
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, **kw)  # type: ignore[arg-type]
    s.add(s.make_seq(rid, list(range(1, prompt_len + 1)), params))


def by_rid(result: StepResult) -> dict[str, Emission]:
    return {e.rid: e for e in result.emissions}


def test_long_prompt_spans_steps_and_the_last_chunk_yields_the_first_token() -> None:
    s = make(chunk=4)
    add(s, "a", 10, 3)
    r1, r2, r3 = s.step(), s.step(), s.step()
    assert list(r1.work.prefill) == [(4, 0)] and not r1.emissions
    assert list(r2.work.prefill) == [(4, 4)] and not r2.emissions
    assert list(r3.work.prefill) == [(2, 8)]
    assert by_rid(r3)["a"].new_ids == expected_output(list(range(1, 11)), SamplingParams(3, 0.0))[0][:1]
    r4 = s.step()
    assert not r4.work.prefill and list(r4.work.decode_contexts) == [11]


def test_budget_is_shared_fcfs_and_decodes_join_every_step() -> None:
    s = make(chunk=8)
    add(s, "a", 5, 4)
    add(s, "b", 6, 4)
    add(s, "c", 3, 4)
    r1 = s.step()
    # a fits whole (5), b gets the remaining 3; c waits for budget
    assert list(r1.work.prefill) == [(5, 0), (3, 0)]
    assert [e.rid for e in r1.emissions] == ["a"]
    r2 = s.step()
    assert list(r2.work.prefill) == [(3, 3), (3, 0)]
    assert list(r2.work.decode_contexts) == [6]  # a: 5 prompt + 1 output
    assert sorted(e.rid for e in r2.emissions) == ["a", "b", "c"]


def test_admission_waits_for_kv_and_for_a_running_slot() -> None:
    s = make(capacity=32, page=4, chunk=64)  # 8 pages
    add(s, "a", 10, 10)  # reserves 5 pages
    add(s, "b", 10, 10)  # needs 5 more: must wait for a
    s.step()
    assert [q.rid for q in s.running] == ["a"] and [q.rid for q in s.waiting] == ["b"]
    while "a" in s:
        s.step()
    assert s.pool.used_pages == 0
    s.step()
    assert [q.rid for q in s.running] == ["b"]

    s = make(max_running=1)
    add(s, "a", 2, 3)
    add(s, "b", 2, 3)
    s.step()
    assert len(s.running) == 1 and len(s.waiting) == 1


def test_abort_frees_pages_wherever_the_request_is() -> None:
    s = make(capacity=64, page=4, chunk=4)
    add(s, "a", 12, 8)
    add(s, "b", 4, 8)
    s.step()
    assert s.pool.used_pages == 1
    assert s.abort("a") is not None and s.abort("b") is not None
    assert s.abort("a") is None
    assert s.pool.used_pages == 0 and not s.has_work
    s.pool.check_integrity()


def test_zero_max_new_tokens_finishes_after_prefill() -> None:
    s = make()
    add(s, "a", 3, 0)
    (e,) = s.step().emissions
    assert e.new_ids == [] and e.finish is not None and e.finish.type == "length"
    assert not s.has_work and s.completed_total == 1


def test_finish_reasons_look_like_sglang() -> None:
    s = make()
    out, _ = expected_output([1, 2, 3], SamplingParams(max_new_tokens=20, temperature=0.0))
    add(s, "len", 3, 2)
    add(s, "stop", 3, 20, stop_token_ids=[out[4]])
    finishes = {}
    while s.has_work:
        for e in s.step().emissions:
            if e.finish is not None:
                finishes[e.rid] = e.finish
    assert (finishes["len"].type, finishes["len"].length) == ("length", 2)
    assert (finishes["stop"].type, finishes["stop"].matched) == ("stop", out[4])


@settings(max_examples=60, deadline=None)
@given(
    reqs=st.lists(st.tuples(st.integers(1, 60), st.integers(0, 12)), min_size=1, max_size=12),
    chunk=st.integers(1, 40),
    max_running=st.integers(1, 6),
    page=st.sampled_from([1, 4, 16]),
)
def test_every_step_respects_the_limits_and_outputs_match_ground_truth(
    reqs: list[tuple[int, int]], chunk: int, max_running: int, page: int
) -> None:
    capacity = max(pages_for(p + n, page) for p, n in reqs) * page + 2 * page
    s = make(capacity=capacity, page=page, max_running=max_running, chunk=chunk)
    for i, (p, n) in enumerate(reqs):
        add(s, f"r{i}", p, n)
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(reqs))}
    done: set[str] = set()
    for _ in range(10_000):
        if not s.has_work:
            break
        decoding_before = sum(1 for q in s.running if not q.prefilling)
        r = s.step()
        assert sum(n for n, _ in r.work.prefill) <= chunk
        assert len(r.work.decode_contexts) == decoding_before
        assert len(s.running) <= max_running
        assert s.kv_tokens_used() <= s.pool.used_pages * page <= s.pool.capacity_tokens
        s.pool.check_integrity()
        for e in r.emissions:
            assert e.rid not in done
            outputs[e.rid].extend(e.new_ids)
            assert len(e.new_ids) <= 1 and e.completion_tokens == len(outputs[e.rid])
            if e.finish is not None:
                done.add(e.rid)
    assert done == set(outputs) and s.pool.used_pages == 0 and s.completed_total == len(reqs)
    for i, (p, n) in enumerate(reqs):
        want, _ = expected_output(list(range(1, p + 1)), SamplingParams(max_new_tokens=n, temperature=0.0))
        assert outputs[f"r{i}"] == want


def test_resumed_requests_queue_ahead_of_new_ones_in_arrival_order() -> None:
    s = make(max_running=1)
    params = SamplingParams(max_new_tokens=3, temperature=0.0)
    for rid, resumed in (("n1", False), ("r1", True), ("n2", False), ("r2", True)):
        seq = s.make_seq(rid, [1, 2, 3], params)
        seq.resumed = resumed
        s.add(seq)
    assert [q.rid for q in s.waiting] == ["r1", "r2", "n1", "n2"]
    s.step()
    assert [q.rid for q in s.running] == ["r1"]


def test_a_recovery_orders_the_queue_shortest_prefill_first_aged_and_then_back_to_fifo() -> None:
    s = make(max_running=1)
    params = SamplingParams(max_new_tokens=3, temperature=0.0)
    # (rid, prompt tokens, queued at, resumed)
    for rid, n, at, resumed in (
        ("long", 3000, 0.0, False),
        ("short", 100, 0.5, False),
        ("r", 900, 2.0, True),
    ):
        seq = s.make_seq(rid, list(range(1, n + 1)), params)
        seq.enqueued_at, seq.resumed = at, resumed
        s.add(seq)
    assert [q.rid for q in s.waiting] == ["r", "long", "short"]
    s.set_rank(aged_shortest_first(0.0))  # not aged: shortest first after the resumed one
    assert [q.rid for q in s.waiting] == ["r", "short", "long"]
    s.set_rank(aged_shortest_first(10_000.0))  # 2,900 more tokens are worth only 0.29 s: long first
    assert [q.rid for q in s.waiting] == ["r", "long", "short"]
    s.set_rank(aged_shortest_first(1_000.0))  # ... 2.9 s: the short one (0.5 s later) first
    late = s.make_seq("late", list(range(1, 51)), params)
    late.enqueued_at = 4.0  # 50 tokens at 4 s ranks 4.05: behind long (3.0), ahead of nothing else
    s.add(late)
    assert [q.rid for q in s.waiting] == ["r", "short", "long", "late"]
    s.set_rank(None)  # the recovery is over: resumed first, then FIFO again
    assert [q.rid for q in s.waiting] == ["r", "long", "short", "late"]
