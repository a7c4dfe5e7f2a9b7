"""EVALUATION.md's metric definitions: hand-worked cases and a few properties."""

import math
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.evaluation import (
    Impact,
    RecordArrays,
    RequestRecord,
    checkpoint_coverage,
    failure_impact,
    holder_balance,
    mean,
    mean_metric,
    mean_present,
    outcomes,
    tpot,
    ttft,
    window_means,
    windowed_recovery_time,
)


def done(arrival: float, ttft_s: float, tokens: int = 11, tpot_s: float = 0.05) -> RequestRecord:
    first = arrival + ttft_s
    return RequestRecord(arrival, first, first + tpot_s * (tokens - 1), tokens)


def run(ttft_per_window: Sequence[float | None], per_window: int = 2) -> list[RequestRecord]:
    """Requests arriving at 2 s windows' starts and middles with the given TTFT (None: they error)."""
    out = []
    for k, t in enumerate(ttft_per_window):
        for j in range(per_window):
            arrival = 2.0 * k + j * 2.0 / per_window
            if t is None:
                out.append(RequestRecord(arrival, None, None, 0, interrupted=True, error=True))
            else:
                out.append(done(arrival, t))
    return out


def test_ttft_and_tpot_per_request() -> None:
    r = RequestRecord(arrival=1.0, first_token=1.5, last_token=3.5, output_tokens=5)
    assert ttft(r) == 0.5
    assert tpot(r) == 0.5  # (3.5 - 1.5) / (5 - 1)
    assert tpot(RequestRecord(1.0, 1.5, 1.5, 1)) is None  # one token: no inter-token time
    assert ttft(RequestRecord(1.0, 1.5, 2.0, 3, error=True)) is None  # truncated: an error only
    assert tpot(RequestRecord(1.0, None, None, 0, error=True)) is None


def test_cluster_means_are_over_requests() -> None:
    rs = [RequestRecord(0.0, 1.0, 2.0, 3), RequestRecord(0.0, 3.0, 9.0, 4), RequestRecord(0.0, 1.0, 1.0, 1)]
    assert mean_metric(rs, "ttft") == pytest.approx(5.0 / 3)
    assert mean_metric(rs, "tpot") == pytest.approx((0.5 + 2.0) / 2)  # the 1-token request has none
    assert mean_metric([], "ttft") is None


def test_window_means_bucket_by_arrival() -> None:
    rs = [done(0.0, 1.0), done(1.9, 3.0), done(2.0, 5.0), done(6.5, 2.0)]
    assert window_means(rs, "ttft") == (2.0, 5.0, None, 2.0)
    assert window_means(rs, "ttft", origin=-1.0, window_s=3.0) == (2.0, 5.0, 2.0)
    with pytest.raises(ValueError, match="origin"):
        window_means(rs, "ttft", origin=1.0)


def test_recovery_time_hand_worked() -> None:
    baseline = run([1.0] * 10)
    # failure at 5.0 s (window 2 = [4, 6)); windows 2 and 3 are slow, window 4 is within 1.1x
    failed = run([1.0, 1.0, 3.0, 2.0, 1.05, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert windowed_recovery_time(failed, baseline, failure_at=5.0) == pytest.approx(3.0)  # 8.0 - 5.0
    # a brief relapse in window 6 moves the end to 14.0
    relapse = run([1.0, 1.0, 3.0, 2.0, 1.05, 1.0, 1.2, 1.0, 1.0, 1.0])
    assert windowed_recovery_time(relapse, baseline, failure_at=5.0) == pytest.approx(9.0)
    # an unaffected run recovers at once, even before its failure window ends
    assert windowed_recovery_time(baseline, baseline, failure_at=5.0) == 0.0
    # slow windows before the failure do not count
    early = run([9.0, 9.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert windowed_recovery_time(early, run([1.0] * 7), failure_at=4.0) == 0.0


def test_never_recovered_is_none() -> None:
    baseline = run([1.0] * 10)
    assert windowed_recovery_time(run([1.0] * 9 + [5.0]), baseline, failure_at=5.0) is None
    # the last bad window leaves only 2 windows to confirm: not enough
    assert windowed_recovery_time(run([1.0] * 7 + [5.0, 1.0, 1.0]), baseline, failure_at=5.0) is None
    assert windowed_recovery_time(
        run([1.0] * 6 + [5.0, 1.0, 1.0, 1.0]), baseline, failure_at=5.0
    ) == pytest.approx(9.0)


def test_window_edge_cases() -> None:
    baseline = run([1.0, 1.0, 1.0, None, 1.0, 1.0, 1.0, 1.0])
    # a window where every request errored is not recovered; one the baseline lacks is skipped
    errored = run([1.0, 1.0, None, 1.0, 1.0, 1.0, 1.0, 1.0])
    assert windowed_recovery_time(errored, baseline, failure_at=4.5) == pytest.approx(1.5)
    # skipped windows do not count toward the 3: after window 4 only windows 5 and 7 compare
    late = run([1.0, 1.0, 1.0, 1.0, 9.0, 1.0, 1.0, 1.0])
    gap: list[float | None] = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, None, 1.0]
    assert windowed_recovery_time(late, run(gap), failure_at=1.0) is None
    assert windowed_recovery_time(late, run([1.0] * 8), failure_at=1.0) == pytest.approx(9.0)
    # the TPOT variant uses the same windows
    assert windowed_recovery_time(baseline, baseline, failure_at=3.0, metric="tpot") == 0.0


def test_failure_impact_window() -> None:
    rs = [done(1.0, 1.0), done(5.0, 3.0), done(7.0, 5.0, tokens=3, tpot_s=0.2), done(9.0, 1.0)]
    impact = failure_impact(rs, 5.0, 2.0)
    assert (impact.mean_ttft, impact.requests) == (4.0, 2)
    assert impact.mean_tpot == pytest.approx(0.125)
    assert failure_impact(rs, 5.0, None).requests == 3


def test_coverage_and_balance() -> None:
    assert checkpoint_coverage([True, False, True, True]) == 0.75
    assert checkpoint_coverage([]) is None
    assert holder_balance([300, 100, 150]) == 3.0
    assert holder_balance([0, 0]) == 1.0
    assert holder_balance([10, 0]) == math.inf
    assert holder_balance([]) is None


records = st.builds(
    lambda a, t, n, err, intr: RequestRecord(
        a, None if n == 0 else a + t, None if n == 0 else a + t + n * 0.01, n, intr, err
    ),
    st.floats(0, 100),
    st.floats(0, 10),
    st.integers(0, 50),
    st.booleans(),
    st.booleans(),
)


@given(st.lists(records, max_size=50))
def test_errors_and_completed_add_up(rs: list[RequestRecord]) -> None:
    o = outcomes(rs)
    assert o.errors + o.completed == o.total == len(rs)
    assert o.interrupted == sum(r.interrupted for r in rs)


@given(st.lists(records, max_size=50))
def test_a_run_compared_with_itself_recovers_at_once(rs: list[RequestRecord]) -> None:
    t = windowed_recovery_time(rs, rs, failure_at=0.0)
    windows = [m for m in window_means(rs, "ttft") if m is not None]
    assert t == (0.0 if len(windows) >= 3 else None)


def test_invalid_records_raise() -> None:
    with pytest.raises(ValueError, match="both"):
        RequestRecord(0.0, 1.0, None, 1)
    with pytest.raises(ValueError, match="arrival <= first_token"):
        RequestRecord(2.0, 1.0, 3.0, 2)
    with pytest.raises(ValueError, match="at least 1"):
        RequestRecord(0.0, 1.0, 1.0, 0)


# -- the columns (RecordArrays, numpy) against the loops they replaced ------------------------------


def ref_mean_metric(rs: Sequence[RequestRecord], metric: str) -> float | None:
    fn = ttft if metric == "ttft" else tpot
    present = [v for v in (fn(r) for r in rs) if v is not None]
    return math.fsum(present) / len(present) if present else None


def ref_window_means(
    rs: Sequence[RequestRecord], metric: str, origin: float, window_s: float
) -> tuple[float | None, ...]:
    fn = ttft if metric == "ttft" else tpot
    buckets: dict[int, list[float]] = {}
    for r in rs:
        k = math.floor((r.arrival - origin) / window_s)
        value = fn(r)
        bucket = buckets.setdefault(k, [])
        if value is not None:
            bucket.append(value)
    n = max(buckets) + 1 if buckets else 0
    return tuple(math.fsum(b) / len(b) if (b := buckets.get(k, [])) else None for k in range(n))


varied = st.builds(
    lambda a, t, span, n, err, intr, delay: RequestRecord(
        a, None if n == 0 else a + t, None if n == 0 else a + t + span * (n > 1), n, intr, err, delay
    ),
    st.one_of(st.integers(0, 40).map(lambda k: k / 4), st.floats(0, 100)),
    st.one_of(st.sampled_from([0.0, 0.1, 1.0]), st.floats(0, 10)),
    st.floats(0, 30),
    st.integers(0, 50),
    st.booleans(),
    st.booleans(),
    st.one_of(st.none(), st.floats(0, 5)),
)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(varied, max_size=60),
    st.floats(-10, 110),
    st.one_of(st.none(), st.floats(0, 50)),
    st.sampled_from([0.7, 2.0, 5.0]),
)
def test_columns_give_the_loops_values(
    rs: list[RequestRecord], fail: float, recovery: float | None, w: float
) -> None:
    """Every summary computed on the columns equals the loop over the records, exactly."""
    cols = RecordArrays.of(rs)
    assert cols.records() == tuple(rs) and RecordArrays.of(iter(rs)).records() == tuple(rs)
    for source in (rs, cols):
        for metric in ("ttft", "tpot"):
            assert mean_metric(source, metric) == ref_mean_metric(rs, metric)
            assert window_means(source, metric, -1.0, w) == ref_window_means(rs, metric, -1.0, w)
        o = outcomes(source)
        assert (o.total, o.errors, o.interrupted) == (
            len(rs),
            sum(r.error for r in rs),
            sum(r.interrupted for r in rs),
        )
        end = math.inf if recovery is None else fail + recovery
        inside = [r for r in rs if fail <= r.arrival <= end]
        impact = failure_impact(source, fail, recovery)
        assert impact == Impact(ref_mean_metric(inside, "ttft"), ref_mean_metric(inside, "tpot"), len(inside))
    assert mean_present(cols.resume_delay) == mean(r.resume_delay for r in rs)
