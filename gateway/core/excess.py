"""Recovery measured against the no-failure twin: per-request excess, smoothed, sustained (docs/evaluation.md).

The failure run and its twin serve the SAME requests (same arrivals, lengths, seed); only the failure
differs. For request i, excess e_i = metric_fail(i) − metric_twin(i): what the failure cost that very
request, with the request's own size and the load it arrived into cancelled out.

- Smoothed excess s_i: the median of e_j over the requests arriving within ± `smooth_s` / 2 of request
  i, the window widened (by arrival order) to hold at least `min_requests`. A centred median follows a
  monotone curve without lag and ignores any minority of outliers: one slow request never moves it.
- Bound b_i = max(floor, `bound_rel` × the twin's median over the same window): "no-failure level"
  within the slack EVALUATION.md gives (10 %), never tighter than the clock's noise floor.
- Recovery instant: the first t >= failure (the failure itself, or the arrival of a request) such
  that every request arriving in [t, t + `sustain_s`] has s_i <= b_i and the run has arrivals at or
  after t + `sustain_s` to show it. Recovery time = t − failure; None when the run ends first.
- Damage (excess request-seconds): Σ e_i over the requests served in both runs, i.e. how many
  request-seconds of metric the failure added in all (for TTFT: waiting clients × seconds).

A request the twin did not serve is left out (nothing to compare with). One that failed only in the
failure run counts as unbounded excess for recovery (service is not back while requests fail) and
is left out of the damage (it is a client error, counted as one).
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from gateway.core.evaluation import RequestRecord, tpot, ttft
from gateway.core.types import check

Metric = Literal["ttft", "tpot"]
_METRICS = {"ttft": ttft, "tpot": tpot}


@dataclass(frozen=True, slots=True)
class RecoveryParams:
    """The recovery measure's knobs; every default of the measure lives here."""

    smooth_s: float = 10.0  # width of the centred median window, seconds of arrivals
    min_requests: int = 5  # a window holds at least this many requests (widened by arrival order)
    bound_rel: float = 0.10  # excess allowed, as a share of the twin's smoothed value
    floor_ttft_s: float = 0.05  # ... and never below these (clock and scheduling noise)
    floor_tpot_s: float = 0.002
    sustain_s: float = 20.0  # the smoothed excess stays within the bound this long

    def __post_init__(self) -> None:
        check(self.smooth_s >= 0, "smooth_s", self.smooth_s, "must be >= 0")
        check(self.min_requests >= 1, "min_requests", self.min_requests, "must be >= 1")
        check(self.bound_rel >= 0, "bound_rel", self.bound_rel, "must be >= 0")
        check(self.floor_ttft_s >= 0, "floor_ttft_s", self.floor_ttft_s, "must be >= 0")
        check(self.floor_tpot_s >= 0, "floor_tpot_s", self.floor_tpot_s, "must be >= 0")
        check(self.sustain_s >= 0, "sustain_s", self.sustain_s, "must be >= 0")

    def floor(self, metric: Metric) -> float:
        return self.floor_ttft_s if metric == "ttft" else self.floor_tpot_s


@dataclass(frozen=True, slots=True)
class ExcessPoint:
    """One request served by the twin: its arrival, its excess (inf: it failed only in the failure
    run) and the twin's value."""

    arrival: float
    excess: float
    reference: float


@dataclass(frozen=True, slots=True)
class RecoveryMeasure:
    recovery_s: float | None  # None: not recovered before the run's arrivals ended
    excess_request_s: float  # Σ excess over requests served in both runs
    lost: int  # requests the twin served and the failure run did not
    compared: int  # requests the twin served


def paired_excess(
    failed: Sequence[RequestRecord], twin: Sequence[RequestRecord], metric: Metric = "ttft"
) -> list[ExcessPoint]:
    """Per-request excess, the records of both runs paired by position (request index), sorted by
    arrival in the failure run."""
    if len(failed) != len(twin):
        raise ValueError(
            f"the failure run has {len(failed)} requests and its twin {len(twin)}: "
            "a twin must serve the same requests"
        )
    fn = _METRICS[metric]
    points: list[ExcessPoint] = []
    for f, t in zip(failed, twin, strict=True):
        ref = fn(t)
        if ref is None:
            continue
        got = fn(f)
        if got is None and not f.error:
            continue  # no value in either sense (e.g. one output token: no TPOT)
        points.append(ExcessPoint(f.arrival, math.inf if got is None else got - ref, ref))
    points.sort(key=lambda p: p.arrival)
    return points


def _windows(times: Sequence[float], half_s: float, min_n: int) -> list[tuple[int, int]]:
    """[lo, hi) per point: the arrivals within ± half_s, widened by index to >= min_n points.

    Both ends are non-decreasing in the point's index (the rolling median relies on it)."""
    n = len(times)
    h = min_n // 2
    out: list[tuple[int, int]] = []
    lo = hi = 0
    for i, t in enumerate(times):
        while times[lo] < t - half_s:
            lo += 1
        while hi < n and times[hi] <= t + half_s:
            hi += 1
        a = min(lo, max(0, i - h), max(0, n - min_n))
        b = max(hi, min(n, i + h + 1), min(n, min_n))
        out.append((a, b))
    return out


def rolling_median(values: Sequence[float], windows: Sequence[tuple[int, int]]) -> list[float]:
    """The median of values[lo:hi] for each (lo, hi); both ends must be non-decreasing."""
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


def smoothed(
    points: Sequence[ExcessPoint], params: RecoveryParams, metric: Metric = "ttft"
) -> tuple[list[float], list[float]]:
    """(smoothed excess, bound) per point; `points` sorted by arrival."""
    if not points:
        return [], []
    windows = _windows([p.arrival for p in points], params.smooth_s / 2, params.min_requests)
    s = rolling_median([p.excess for p in points], windows)
    ref = rolling_median([p.reference for p in points], windows)
    floor = params.floor(metric)
    return s, [max(floor, params.bound_rel * r) for r in ref]


def recovery_from(
    points: Sequence[ExcessPoint],
    failure_at: float,
    params: RecoveryParams | None = None,
    metric: Metric = "ttft",
) -> float | None:
    """Seconds from `failure_at` until the smoothed excess stays within its bound for `sustain_s`."""
    params = params or RecoveryParams()
    s, bound = smoothed(points, params, metric)
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


def measure(
    failed: Sequence[RequestRecord],
    twin: Sequence[RequestRecord],
    failure_at: float,
    metric: Metric = "ttft",
    params: RecoveryParams | None = None,
) -> RecoveryMeasure:
    """Recovery time and damage of a failure run against its no-failure twin."""
    points = paired_excess(failed, twin, metric)
    finite = [p.excess for p in points if math.isfinite(p.excess)]
    return RecoveryMeasure(
        recovery_s=recovery_from(points, failure_at, params, metric),
        excess_request_s=math.fsum(finite),
        lost=len(points) - len(finite),
        compared=len(points),
    )
