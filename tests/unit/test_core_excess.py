"""The twin-based recovery measure (gateway/core/excess.py): series with known answers, properties."""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core import excess
from gateway.core.evaluation import RecordArrays, RequestRecord, tpot, ttft
from gateway.core.excess import (
    ExcessPoint,
    Metric,
    RecoveryParams,
    measure,
    paired_excess,
    recovery_from,
    rolling_median,
    smoothed,
    window_bounds,
    window_medians,
)
from gateway.core.types import ParamError

RATE = 4.0  # requests per second in the synthetic series
FAIL = 30.0
END = 160.0
P = RecoveryParams()


def series(
    excess_at: dict[int, float] | None = None, step_s: float = 0.0, height: float = 1.0
) -> list[ExcessPoint]:
    """Requests every 1/RATE s over [0, END); excess `height` for arrivals in [FAIL, FAIL + step_s),
    plus single requests' excess overridden by `excess_at` (index -> excess); twin TTFT 0.2 s."""
    points = []
    for i in range(int(END * RATE)):
        a = i / RATE
        e = height if FAIL <= a < FAIL + step_s else 0.0
        points.append(ExcessPoint(a, (excess_at or {}).get(i, e), 0.2))
    return points


def test_zero_excess_recovers_at_once() -> None:
    assert recovery_from(series(), FAIL) == 0.0


@settings(max_examples=40, deadline=None)
@given(st.floats(P.smooth_s / 2 + 0.5, 100.0), st.floats(0.06, 50.0))
def test_a_step_of_d_seconds_recovers_in_about_d(d: float, height: float) -> None:
    got = recovery_from(series(step_s=d, height=height), FAIL)
    assert got is not None and got == pytest.approx(d, abs=1.5 / RATE)


def test_a_step_shorter_than_half_the_smoothing_is_below_resolution() -> None:
    # the median window is smooth_s wide: excess over less than half of it is a minority there
    assert recovery_from(series(step_s=P.smooth_s / 2 - 0.5, height=9.0), FAIL) == 0.0


# steps clear of the smoothing's resolution edge: a step of half the median window holds exactly half
# of it, a tie one outlier decides (hypothesis found d = 5 s: 0 s clean, 5.25 s with one outlier)
RESOLVED_STEPS = st.one_of(st.floats(1.0, P.smooth_s / 2 - 0.5), st.floats(P.smooth_s / 2 + 0.5, 100.0))


@settings(max_examples=40, deadline=None)
@given(RESOLVED_STEPS, st.floats(0.06, 50.0), st.integers(0, int(END * RATE) - 1))
def test_one_outlier_never_extends_recovery(d: float, height: float, outlier: int) -> None:
    """One slow (or failed) request moves the median's crossing by one request at most, and only when it
    sits at the step's edge; elsewhere it changes nothing."""
    clean = recovery_from(series(step_s=d, height=height), FAIL)
    assert clean is not None
    for bad in (1e6, math.inf):
        noisy = recovery_from(series({outlier: bad}, step_s=d, height=height), FAIL)
        assert noisy is not None and noisy <= clean + 1 / RATE + 1e-9
    far = int((FAIL + d + P.smooth_s) * RATE) + 1
    if far < END * RATE:
        assert recovery_from(series({far: 1e6}, step_s=d, height=height), FAIL) == clean


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(-1.0, 5.0), min_size=40, max_size=40),
    st.floats(0.0, 1.0),
    st.floats(0.0, 1.0),
)
def test_monotonic_in_the_bound(bumps: list[float], rel_a: float, rel_b: float) -> None:
    """A looser bound never gives a longer recovery (None: never, the longest)."""
    points = [ExcessPoint(i / 2, bumps[(i // 5) % len(bumps)], 1.0) for i in range(400)]
    lo, hi = sorted((rel_a, rel_b))
    tight = recovery_from(points, 10.0, RecoveryParams(bound_rel=lo, sustain_s=15.0))
    loose = recovery_from(points, 10.0, RecoveryParams(bound_rel=hi, sustain_s=15.0))
    assert (math.inf if loose is None else loose) <= (math.inf if tight is None else tight)


def test_not_recovered_before_the_run_ends_is_none() -> None:
    # bad until 20 s before the end: the sustain period cannot be shown
    assert recovery_from(series(step_s=END - FAIL - 10), FAIL) is None
    # a relapse inside the sustain period restarts it
    relapse = series(step_s=10.0)
    relapse = [
        ExcessPoint(p.arrival, 1.0 if 50.0 <= p.arrival < 58.0 else p.excess, p.reference) for p in relapse
    ]
    got = recovery_from(relapse, FAIL)
    assert got == pytest.approx(28.0, abs=2 / RATE)


def test_excess_before_the_failure_does_not_count() -> None:
    pre = [ExcessPoint(p.arrival, 3.0 if p.arrival < FAIL - 10 else p.excess, p.reference) for p in series()]
    assert recovery_from(pre, FAIL) == 0.0


def test_bound_is_relative_with_a_floor() -> None:
    # excess 0.15 on a twin TTFT of 1.0: within 20 %, not within 10 %
    points = [ExcessPoint(i / RATE, 0.15 if i / RATE >= FAIL else 0.0, 1.0) for i in range(int(END * RATE))]
    assert recovery_from(points, FAIL, RecoveryParams(bound_rel=0.2)) == 0.0
    assert recovery_from(points, FAIL, RecoveryParams(bound_rel=0.1)) is None
    # the floor: 0.04 s of excess on a 0.1 s twin is noise
    small = [ExcessPoint(p.arrival, 0.04 if p.arrival >= FAIL else 0.0, 0.1) for p in points]
    assert recovery_from(small, FAIL) == 0.0


def test_rolling_median() -> None:
    values = [5.0, 1.0, 3.0, math.inf, 2.0]
    assert rolling_median(values, [(0, 1), (0, 3), (1, 4), (2, 5)]) == [5.0, 3.0, 3.0, 3.0]
    assert rolling_median(values, [(0, 2)]) == [3.0]
    with pytest.raises(ValueError, match="non-decreasing"):
        rolling_median(values, [(1, 3), (0, 3)])


def rec(arrival: float, ttft_s: float | None, tokens: int = 5) -> RequestRecord:
    if ttft_s is None:
        return RequestRecord(arrival, None, None, 0, interrupted=True, error=True)
    return RequestRecord(arrival, arrival + ttft_s, arrival + ttft_s + 0.1 * (tokens - 1), tokens)


def test_measure_pairs_requests_and_sums_the_damage() -> None:
    twin = [rec(i * 0.5, 0.2) for i in range(200)]
    failed = [rec(i * 0.5, 1.2 if 20 <= i < 40 else 0.2) for i in range(200)]
    failed[25] = rec(12.5, None)  # failed only in the failure run
    m = measure(failed, twin, failure_at=10.0, params=RecoveryParams(sustain_s=10.0))
    assert m.excess_request_s == pytest.approx(19 * 1.0)
    assert (m.lost, m.compared) == (1, 200)
    assert m.recovery_s == pytest.approx(10.0)
    # a request the twin did not serve is not compared
    twin[30] = rec(15.0, None)
    assert measure(failed, twin, 10.0).compared == 199
    # TPOT: the same pairing on the other metric (no excess here)
    assert measure(failed, twin, 10.0, "tpot").excess_request_s == pytest.approx(0.0)
    with pytest.raises(ValueError, match="same requests"):
        paired_excess(failed[:-1], twin)


def test_params_are_checked() -> None:
    with pytest.raises(ParamError, match="sustain_s"):
        RecoveryParams(sustain_s=-1.0)
    with pytest.raises(ParamError, match="min_requests"):
        RecoveryParams(min_requests=0)


# -- the vectorised measure against the loops it replaced -------------------------------------------
# The measure computes on numpy columns (gateway/core/excess.py). These are the loop forms it had
# before, kept as references: on any series the columns must give the same answers exactly.


def ref_windows(times: Sequence[float], half_s: float, min_n: int) -> list[tuple[int, int]]:
    n = len(times)
    h = min_n // 2
    out: list[tuple[int, int]] = []
    lo = hi = 0
    for i, t in enumerate(times):
        while times[lo] < t - half_s:
            lo += 1
        while hi < n and times[hi] <= t + half_s:
            hi += 1
        out.append((min(lo, max(0, i - h), max(0, n - min_n)), max(hi, min(n, i + h + 1), min(n, min_n))))
    return out


def ref_rolling_median(values: Sequence[float], windows: Sequence[tuple[int, int]]) -> list[float]:
    window: list[float] = []
    lo = hi = 0
    out: list[float] = []
    for a, b in windows:
        if a < lo or b < hi:
            raise ValueError("window ends must be non-decreasing")
        for v in values[hi:b]:
            insort(window, v)
        for v in values[lo:a]:
            del window[bisect_left(window, v)]
        lo, hi = a, b
        m = len(window)
        if m == 0:
            raise ValueError("empty window")
        out.append(window[m // 2] if m % 2 else (window[m // 2 - 1] + window[m // 2]) / 2)
    return out


def ref_smoothed(
    points: Sequence[ExcessPoint], params: RecoveryParams, metric: Metric
) -> tuple[list[float], list[float]]:
    if not points:
        return [], []
    windows = ref_windows([p.arrival for p in points], params.smooth_s / 2, params.min_requests)
    s = ref_rolling_median([p.excess for p in points], windows)
    ref = ref_rolling_median([p.reference for p in points], windows)
    return s, [max(params.floor(metric), params.bound_rel * r) for r in ref]


def ref_recovery_from(
    points: Sequence[ExcessPoint], failure_at: float, params: RecoveryParams, metric: Metric = "ttft"
) -> float | None:
    s, bound = ref_smoothed(points, params, metric)
    start: float | None = failure_at
    for p, si, bi in zip(points, s, bound, strict=True):
        if p.arrival < failure_at:
            continue
        if si > bi:
            start = None
            continue
        if start is None:
            start = p.arrival
        if p.arrival >= start + params.sustain_s:
            return start - failure_at
    return None


def ref_paired_excess(
    failed: Sequence[RequestRecord], twin: Sequence[RequestRecord], metric: Metric
) -> list[ExcessPoint]:
    fn = ttft if metric == "ttft" else tpot
    points: list[ExcessPoint] = []
    for f, t in zip(failed, twin, strict=True):
        ref = fn(t)
        if ref is None:
            continue
        got = fn(f)
        if got is None and not f.error:
            continue
        points.append(ExcessPoint(f.arrival, math.inf if got is None else got - ref, ref))
    points.sort(key=lambda p: p.arrival)
    return points


# arrivals on a coarse grid (ties) or anywhere; excess with ties, zeros, failures (inf) and negatives
ARRIVALS = st.one_of(
    st.lists(st.integers(0, 160).map(lambda k: k / 4), max_size=90),
    st.lists(st.floats(0.0, 60.0), max_size=90),
)
EXCESS = st.one_of(st.sampled_from([0.0, 0.01, 0.05, 0.2, 1.0, 3.0, -0.1, math.inf]), st.floats(-1.0, 50.0))
REFERENCE = st.one_of(st.sampled_from([0.0, 0.1, 0.2, 1.0]), st.floats(0.0, 5.0))
PARAMS = st.builds(
    RecoveryParams,
    smooth_s=st.sampled_from([0.0, 0.5, 2.0, 10.0]),
    min_requests=st.integers(1, 8),
    bound_rel=st.sampled_from([0.0, 0.1, 0.5]),
    sustain_s=st.sampled_from([0.0, 0.75, 5.0, 20.0]),
)


@st.composite
def excess_points(draw: st.DrawFn) -> list[ExcessPoint]:
    arrivals = sorted(draw(ARRIVALS))
    return [ExcessPoint(a, draw(EXCESS), draw(REFERENCE)) for a in arrivals]


@settings(max_examples=300, deadline=None)
@given(excess_points(), PARAMS, st.floats(-5.0, 70.0), st.sampled_from([1, 2, 3, 4096]))
def test_recovery_equals_the_loop(
    points: list[ExcessPoint], params: RecoveryParams, fail: float, chunk: int
) -> None:
    """recovery_from (windows by binary search, medians by selection, the scan in chunks) answers as
    the loop did, on any series: ties, failed requests, empty runs, failures before or after it all."""
    first = (excess.FIRST_CHUNK, excess.MAX_CHUNK)
    excess.FIRST_CHUNK, excess.MAX_CHUNK = chunk, max(chunk, 4)  # small chunks: the scan's carry
    try:
        for metric in ("ttft", "tpot"):
            assert recovery_from(points, fail, params, metric) == ref_recovery_from(
                points, fail, params, metric
            )
    finally:
        excess.FIRST_CHUNK, excess.MAX_CHUNK = first
    if points:
        assert window_bounds_list(points, params) == ref_windows(
            [p.arrival for p in points], params.smooth_s / 2, params.min_requests
        )
    assert smoothed(points, params) == ref_smoothed(points, params, "ttft")


def window_bounds_list(points: Sequence[ExcessPoint], params: RecoveryParams) -> list[tuple[int, int]]:
    lo, hi = window_bounds(np.array([p.arrival for p in points]), params.smooth_s / 2, params.min_requests)
    return list(zip(lo.tolist(), hi.tolist(), strict=True))


@settings(max_examples=300, deadline=None)
@given(st.lists(EXCESS, min_size=1, max_size=60), st.data())
def test_rolling_median_equals_the_sorted_window(values: list[float], data: st.DataObject) -> None:
    """Any non-decreasing windows (repeated, growing, jumping); window_medians also takes any others."""
    n = len(values)
    ends = sorted(data.draw(st.lists(st.integers(0, n), min_size=2, max_size=2 * n + 2)))
    lo, hi = ends[: len(ends) // 2], ends[len(ends) - len(ends) // 2 :]
    windows = [(a, b) for a, b in zip(lo, hi, strict=True) if b > a]
    assert rolling_median(values, windows) == ref_rolling_median(values, windows)
    anywhere = data.draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(1, n)), max_size=20))
    anywhere = [(min(a, b - 1), b) for a, b in anywhere]
    got = window_medians(
        np.array(values),
        np.array([a for a, _ in anywhere], dtype=np.int64),
        np.array([b for _, b in anywhere], dtype=np.int64),
    )
    assert got.tolist() == [ref_rolling_median(values[a:b], [(0, b - a)])[0] for a, b in anywhere]


def test_rolling_median_refuses_what_the_loop_refused() -> None:
    values = [1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="empty"):
        rolling_median(values, [(0, 1), (1, 1), (0, 2)])
    with pytest.raises(ValueError, match="non-decreasing"):
        rolling_median(values, [(0, 2), (1, 1)])
    assert rolling_median(values, []) == []
    assert smoothed([], P) == ([], []) and recovery_from([], 0.0) is None


@st.composite
def paired_runs(draw: st.DrawFn) -> tuple[list[RequestRecord], list[RequestRecord]]:
    """The same requests in two runs: each may fail (error), have no token, or one token only."""

    def one(arrival: float) -> RequestRecord:
        kind = draw(st.sampled_from(["ok", "ok", "ok", "error", "lost", "one"]))
        t = draw(st.sampled_from([0.0, 0.1, 0.5, 2.0]) | st.floats(0.0, 10.0))
        if kind == "lost":
            return RequestRecord(arrival, None, None, 0, interrupted=True, error=True)
        tokens = 1 if kind == "one" else draw(st.integers(2, 40))
        last = arrival + t + draw(st.floats(0.0, 5.0)) * (tokens > 1)
        return RequestRecord(arrival, arrival + t, last, tokens, error=kind == "error")

    arrivals = draw(ARRIVALS)  # in request order, not sorted: the measure sorts by arrival
    return [one(a) for a in arrivals], [one(a) for a in arrivals]


@settings(max_examples=200, deadline=None)
@given(paired_runs(), st.floats(-5.0, 70.0), PARAMS)
def test_measure_equals_the_loop(
    runs: tuple[list[RequestRecord], list[RequestRecord]], fail: float, params: RecoveryParams
) -> None:
    failed, twin = runs
    for metric in ("ttft", "tpot"):
        points = ref_paired_excess(failed, twin, metric)
        assert paired_excess(failed, twin, metric) == points
        finite = [p.excess for p in points if math.isfinite(p.excess)]
        want = (
            ref_recovery_from(points, fail, params, metric),
            math.fsum(finite),
            len(points) - len(finite),
            len(points),
        )
        m = measure(failed, twin, fail, metric, params)
        assert (m.recovery_s, m.excess_request_s, m.lost, m.compared) == want
        assert measure(RecordArrays.of(failed), RecordArrays.of(twin), fail, metric, params) == m
