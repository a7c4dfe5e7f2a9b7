"""Per-key limits (gateway/server/api/ratelimit.py) on an injected clock: the token bucket never admits
more than its burst plus its rate over any window, a refusal's Retry-After is when a retry succeeds,
concurrency is bounded per key, keys are independent, and forgetting idle keys changes nothing."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.server.api.ratelimit import (
    CONCURRENCY_RETRY_AFTER_S,
    KeyLimiter,
    Limits,
    Refused,
    refill,
    retry_after,
)
from tests.fixtures.clock import FakeClock


def test_burst_then_rate_then_retry_after() -> None:
    clock = FakeClock(1000.0)
    lim = KeyLimiter(Limits(rate_per_s=2.0, burst=3), clock)
    assert [lim.admit("k") for _ in range(3)] == [None, None, None]
    for _ in range(3):
        lim.release("k")
    refused = lim.admit("k")
    assert refused == Refused("rate", pytest.approx(0.5))
    assert retry_after(refused.retry_after_s) == "1"
    clock.t += 0.5
    assert lim.admit("k") is None
    assert lim.admit("other") is None  # keys are independent


def test_concurrency_limit_and_release() -> None:
    lim = KeyLimiter(Limits(max_concurrent=2), FakeClock(1000.0))
    assert lim.admit("k") is None and lim.admit("k") is None
    assert lim.admit("k") == Refused("concurrency", CONCURRENCY_RETRY_AFTER_S)
    assert lim.in_flight("k") == 2
    lim.release("k")
    assert lim.admit("k") is None
    with pytest.raises(ValueError, match="release without admit"):
        lim.release("nobody")


def test_defaults_and_bounds() -> None:
    assert not Limits().enabled
    assert Limits(rate_per_s=0.2).capacity == 1 and Limits(rate_per_s=7.5).capacity == 8
    assert Limits(rate_per_s=1, burst=20).capacity == 20
    with pytest.raises(ValueError):
        Limits(rate_per_s=math.inf)
    with pytest.raises(ValueError):
        Limits(max_concurrent=-1)
    assert [retry_after(s) for s in (0.0, 0.01, 1.0, 1.0000001, 2.5)] == ["1", "1", "1", "2", "3"]


def test_refill_is_capped_and_ignores_a_clock_going_back() -> None:
    assert refill(0.0, 10.0, 1.0, 3.0) == 3.0
    assert refill(1.0, -5.0, 1.0, 3.0) == 1.0


# a request: (key, seconds since the previous one, hold it in flight)
requests = st.lists(
    st.tuples(st.sampled_from("abc"), st.floats(0, 2, allow_nan=False), st.booleans()), max_size=120
)


@settings(max_examples=200)
@given(
    rate=st.floats(0.1, 50, allow_nan=False),
    burst=st.integers(0, 10),
    max_concurrent=st.integers(0, 4),
    reqs=requests,
)
def test_admissions_stay_within_the_limits(
    rate: float, burst: int, max_concurrent: int, reqs: list[tuple[str, float, bool]]
) -> None:
    clock = FakeClock(1000.0)
    limits = Limits(max_concurrent=max_concurrent, rate_per_s=rate, burst=burst)
    lim = KeyLimiter(limits, clock, sweep_min_keys=1)  # sweeps as often as it can
    admitted: dict[str, list[float]] = {}
    held: dict[str, int] = {}
    for key, gap, hold in reqs:
        clock.t += gap
        before = lim.in_flight(key)
        verdict = lim.admit(key)
        if verdict is None:
            admitted.setdefault(key, []).append(clock.t)
            if hold:
                held[key] = held.get(key, 0) + 1
            else:
                lim.release(key)
        else:
            assert verdict.retry_after_s > 0
            if verdict.reason == "concurrency":
                assert max_concurrent and before == max_concurrent
        if max_concurrent:
            assert lim.in_flight(key) <= max_concurrent
        assert lim.in_flight(key) == held.get(key, 0)
    # over any window [t_i, t_j], a key is admitted at most capacity + rate * (t_j - t_i) times
    for times in admitted.values():
        for i in range(len(times)):
            for j in range(i, len(times)):
                assert j - i + 1 <= limits.capacity + rate * (times[j] - times[i]) + 1e-6


@settings(max_examples=200)
@given(
    rate=st.floats(0.1, 50, allow_nan=False),
    burst=st.integers(0, 5),
    gaps=st.lists(st.floats(0, 0.5, allow_nan=False), min_size=1, max_size=40),
)
def test_retry_after_is_when_a_retry_succeeds(rate: float, burst: int, gaps: list[float]) -> None:
    clock = FakeClock(1000.0)
    lim = KeyLimiter(Limits(rate_per_s=rate, burst=burst), clock)
    for gap in gaps:
        clock.t += gap
        verdict = lim.admit("k")
        if verdict is None:
            lim.release("k")
            continue
        clock.t += verdict.retry_after_s * (1 + 1e-9) + 1e-9
        assert lim.admit("k") is None
        lim.release("k")


@settings(max_examples=100)
@given(reqs=requests, rate=st.floats(0.1, 10, allow_nan=False))
def test_forgetting_idle_keys_changes_no_verdict(reqs: list[tuple[str, float, bool]], rate: float) -> None:
    """A limiter that sweeps at every chance and one that never does decide alike."""
    clock = FakeClock(1000.0)
    limits = Limits(max_concurrent=2, rate_per_s=rate)
    eager, never = (
        KeyLimiter(limits, clock, sweep_min_keys=0),
        KeyLimiter(limits, clock, sweep_min_keys=10**9),
    )
    for key, gap, hold in reqs:
        clock.t += gap
        a, b = eager.admit(key), never.admit(key)
        assert (a is None) == (b is None)
        if a is None and not hold:
            eager.release(key)
            never.release(key)
    assert len(eager) <= len(never)


# -- fair shares of work (issue 29) ----------------------------------------------------------------
def test_fair_share_admits_a_keys_first_job_at_once_and_queues_a_busy_keys_work() -> None:
    from gateway.server.api.ratelimit import FairShare

    share = FairShare(lambda: 100)
    a1 = share.request("a", 80)
    a2 = share.request("a", 80)  # over capacity: waits
    b1 = share.request("b", 80)  # nothing of b's in flight: starts at once, whatever a holds
    assert (a1.admitted, a2.admitted, b1.admitted) == (True, False, True)
    a3 = share.request("a", 10)
    assert not a3.admitted  # behind a2: FIFO per key
    # the first token of a1: its prompt is done; still over capacity with b's work
    assert share.done(a1, 70) == [] and share.in_flight == 90
    # b1 ends: capacity frees for a's queue, in order (both fit now)
    assert share.release(b1) == [a2, a3]
    assert share.release(a1) == []
    share.release(a2)
    share.release(a3)
    assert share.in_flight == 0 and share.waiting() == 0


def test_fair_share_serves_the_least_served_key_first() -> None:
    from gateway.server.api.ratelimit import FairShare

    share = FairShare(lambda: 100)
    big = [share.request("a", 50) for _ in range(4)]  # a: two in flight, two waiting
    small = share.request("b", 10)  # b's first: at once
    b2 = share.request("b", 10)  # b's second waits (over capacity)
    assert [t.admitted for t in big] == [True, True, False, False] and small.admitted and not b2.admitted
    # capacity frees: b holds less than a, so b's job goes before a's queued ones
    assert share.release(big[0]) == [b2]
    # a cancelled wait leaves the queue
    assert share.release(big[3]) == [] and share.waiting() == 1
    for t in (big[1], small, b2):
        share.release(t)
    assert share.in_flight == 50 and share.waiting() == 0  # big[2] took the room
    share.release(big[2])
    assert share.in_flight == 0
