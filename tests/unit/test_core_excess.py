"""The twin-based recovery measure (gateway/core/excess.py): series with known answers, properties."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.evaluation import RequestRecord
from gateway.core.excess import (
    ExcessPoint,
    RecoveryParams,
    measure,
    paired_excess,
    recovery_from,
    rolling_median,
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
