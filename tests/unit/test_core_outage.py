"""Survivors' admission during an outage (gateway.core.outage): queue order and batch limit."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.core.outage import (
    OutageParams,
    admission_limit,
    backlog_drained,
    outage_boost,
    queue_first,
    queue_priority,
    queue_rank,
)
from gateway.core.types import ParamError


@given(st.integers(1, 512), st.floats(1.0, 8.0))
def test_the_limit_is_the_base_times_the_boost_rounded_down_and_never_below_it(
    base: int, boost: float
) -> None:
    limit = admission_limit(base, boost)
    assert limit >= base
    assert limit == max(base, int(base * boost))
    if boost == 1.0:
        assert limit == base


@given(st.floats(1.0, 4.0), st.booleans(), st.integers(1, 64), st.integers(0, 64))
def test_the_boost_keeps_the_clusters_batch_slots_up_to_the_cap_and_only_while_recovering(
    cap: float, recovering: bool, workers: int, down: int
) -> None:
    down = min(down, workers)
    boost = outage_boost(OutageParams(batch_boost=cap), recovering, workers, down)
    assert 1.0 <= boost <= cap
    if not recovering or down == 0:
        assert boost == 1.0
    elif down < workers:
        # the serving workers together keep (up to the cap) the slots of the whole cluster
        assert boost == min(cap, workers / (workers - down))


def test_one_of_four_workers_out_gives_a_third_more_slots_and_one_of_two_the_cap() -> None:
    p = OutageParams(batch_boost=1.5)
    assert admission_limit(64, outage_boost(p, True, 4, 1)) == 85
    assert admission_limit(64, outage_boost(p, True, 2, 1)) == 96
    assert admission_limit(64, outage_boost(OutageParams(batch_boost=1.0), True, 2, 1)) == 64


@given(st.integers(0, 10), st.booleans())
def test_only_resumed_attempts_go_first_and_only_when_on(attempt: int, on: bool) -> None:
    assert queue_first(attempt, OutageParams(resumed_first=on)) == (on and attempt > 1)


@given(st.integers(0, 100), st.integers(1, 16), st.booleans())
def test_a_recovery_ends_only_with_every_worker_serving_and_no_backlog(
    waiting: int, serving: int, all_serving: bool
) -> None:
    assert backlog_drained(waiting, serving, all_serving) == (all_serving and waiting <= serving)


@pytest.mark.parametrize("boost", [0.5, 0.999, float("inf"), float("nan")])
def test_a_boost_below_one_or_not_finite_is_refused(boost: float) -> None:
    with pytest.raises(ParamError) as exc:
        OutageParams(batch_boost=boost)
    assert exc.value.field == "batch_boost"


@given(st.integers(0, 6), st.integers(1, 10_000), st.booleans(), st.booleans(), st.booleans())
def test_queue_rank_puts_resumed_first_and_orders_by_prefill_only_while_recovering(
    attempt: int, tokens: int, resumed_first: bool, shortest: bool, recovering: bool
) -> None:
    p = OutageParams(resumed_first=resumed_first, shortest_first=shortest, shortest_first_rate=0.0)
    first, size = queue_rank(attempt, tokens, p, recovering)
    assert first == (0 if queue_first(attempt, p) else 1)
    assert size == (tokens if shortest and recovering else 0)
    # with both levers off the rank is plain FIFO's
    off = OutageParams(resumed_first=False, shortest_first=False)
    assert queue_rank(attempt, tokens, off, recovering) == (1, 0)


def test_a_queue_sorted_by_rank_is_resumed_then_shortest_then_fifo() -> None:
    p = OutageParams(shortest_first=True, shortest_first_rate=0.0)
    queue = [("new-long", 1, 4000), ("resumed", 2, 3000), ("new-short", 1, 200), ("new-short-2", 1, 200)]
    order = sorted(queue, key=lambda q: queue_rank(q[1], q[2], p, True))
    assert [q[0] for q in order] == ["resumed", "new-short", "new-short-2", "new-long"]


@given(
    st.floats(100.0, 50_000.0),
    st.integers(1, 20_000),
    st.integers(1, 20_000),
    st.floats(0.0, 100.0),
    st.floats(0.0, 30.0),
)
def test_an_aged_long_prompt_yields_only_to_requests_arriving_within_its_prefill_over_the_rate(
    rate: float, long_tokens: int, short_tokens: int, t_long: float, later: float
) -> None:
    p = OutageParams(shortest_first=True, shortest_first_rate=rate)
    a = queue_rank(1, long_tokens, p, True, t_long)
    b = queue_rank(1, short_tokens, p, True, t_long + later)
    if b < a:  # b goes first although it arrived later: only if it came soon enough after a
        assert later < long_tokens / rate
    if later >= long_tokens / rate:
        assert a <= b


def test_without_aging_shortest_first_is_pure_and_a_negative_rate_is_refused() -> None:
    p = OutageParams(shortest_first=True, shortest_first_rate=0.0)
    assert queue_rank(1, 500, p, True, arrival=99.0) == (1, 500)
    with pytest.raises(ParamError) as exc:
        OutageParams(shortest_first_rate=-1.0)
    assert exc.value.field == "shortest_first_rate"


# one queued request: (attempt, tokens to prefill, arrival in s)
_queued = st.tuples(st.integers(1, 4), st.integers(1, 200_000), st.floats(0.0, 1e6, allow_nan=False))


@given(st.lists(_queued, min_size=2, max_size=30), st.booleans(), st.sampled_from([500.0, 2000.0, 4000.0]))
def test_a_servers_priority_order_is_the_queue_rank_order_with_fifo_ties(
    reqs: list[tuple[int, int, float]], recovering: bool, rate: float
) -> None:
    """An SGLang server sorts by (priority, queue entry): queued in arrival order, the order it
    serves is the one `queue_rank` gives (ties FIFO), to the millisecond the integers keep."""
    params = OutageParams(shortest_first=True, shortest_first_rate=rate)
    queued = sorted(reqs, key=lambda r: r[2])  # the server's queue is in arrival order
    by_priority = sorted(queued, key=lambda r: queue_priority(r[0], r[1], params, recovering, r[2]))
    by_rank = sorted(queued, key=lambda r: queue_rank(r[0], r[1], params, recovering, r[2]))
    rank = {id(r): queue_rank(r[0], r[1], params, recovering, r[2]) for r in queued}
    for a, b in zip(by_priority, by_rank, strict=True):
        if a is not b:  # only requests within a millisecond of each other may swap
            ra, rb = rank[id(a)], rank[id(b)]
            assert ra[0] == rb[0]
            assert abs((ra[1] or a[2]) - (rb[1] or b[2])) < 1e-3


def test_a_resumed_attempt_goes_ahead_of_any_new_request_and_fifo_holds_outside_a_recovery() -> None:
    params = OutageParams()
    new_early = queue_priority(1, 10, params, False, 5.0)
    new_late = queue_priority(1, 10, params, False, 6.0)
    resumed_late = queue_priority(2, 90_000, params, False, 1e7)
    assert resumed_late < new_early < new_late
    # while recovering, a short prompt arriving 0.1 s after a 4,000-token one goes first (rate 2,000)
    long_first = queue_priority(1, 4000, params, True, 100.0)
    short_after = queue_priority(1, 10, params, True, 100.1)
    assert short_after < long_first
    # ...but not one arriving more than 4000 / 2000 = 2 s later (aging bounds the wait)
    assert queue_priority(1, 10, params, True, 102.1) > long_first
    # shortest-first off: FIFO even while recovering
    fifo = OutageParams(shortest_first=False)
    assert queue_priority(1, 4000, fifo, True, 100.0) < queue_priority(1, 10, fifo, True, 100.1)
