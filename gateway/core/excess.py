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

The measure computes on columns (`ExcessSeries`, numpy) with the arithmetic of the definitions above
taken one request at a time, so its answers are those of that loop exactly: window bounds by binary
search (`window_bounds`), each window's median selected exactly (`window_medians`: a wavelet matrix over
the values' ranks answers "the k-th smallest of values[lo:hi]" for every window at once), the recovery
instant by a vectorised scan in growing chunks from the failure on (the smoothing is computed only as
far as the answer needs), the damage by `math.fsum` (exact). tests/unit/test_core_excess.py keeps the
loop forms as references and property-tests these against them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Literal

import numpy as np
import numpy.typing as npt

from gateway.core.evaluation import RecordArrays, Records
from gateway.core.types import check

Metric = Literal["ttft", "tpot"]


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


@dataclass(frozen=True, slots=True, eq=False)
class ExcessSeries:
    """The excess points as columns, sorted by arrival (as `paired_excess` lists them)."""

    arrival: np.ndarray  # float64, non-decreasing
    excess: np.ndarray  # float64; inf: the request failed only in the failure run
    reference: np.ndarray  # float64: the twin's value

    def __len__(self) -> int:
        return len(self.arrival)

    @staticmethod
    def of_points(points: Sequence[ExcessPoint]) -> ExcessSeries:
        n = len(points)
        return ExcessSeries(
            np.fromiter(map(attrgetter("arrival"), points), np.float64, n),
            np.fromiter(map(attrgetter("excess"), points), np.float64, n),
            np.fromiter(map(attrgetter("reference"), points), np.float64, n),
        )

    def points(self) -> list[ExcessPoint]:
        return [
            ExcessPoint(a, e, r)
            for a, e, r in zip(
                self.arrival.tolist(), self.excess.tolist(), self.reference.tolist(), strict=True
            )
        ]


def excess_series(failed: Records, twin: Records, metric: Metric = "ttft") -> ExcessSeries:
    """Per-request excess, the records of both runs paired by position (request index), sorted by
    arrival in the failure run (stable: requests arriving together keep their order)."""
    f, t = RecordArrays.of(failed), RecordArrays.of(twin)
    if len(f) != len(t):
        raise ValueError(
            f"the failure run has {len(f)} requests and its twin {len(t)}: a twin must serve the same requests"
        )
    ref, got = t.metric(metric), f.metric(metric)
    # a request the twin did not serve is not compared; nor one with no value in either run (e.g. one
    # output token: no TPOT) unless it failed in the failure run (then its excess is unbounded)
    kept = np.flatnonzero(~np.isnan(ref) & (~np.isnan(got) | f.error))
    kept = kept[np.argsort(f.arrival[kept], kind="stable")]
    g, r = got[kept], ref[kept]
    return ExcessSeries(f.arrival[kept], np.where(np.isnan(g), np.inf, g - r), r)


def paired_excess(failed: Records, twin: Records, metric: Metric = "ttft") -> list[ExcessPoint]:
    """Per-request excess, the records of both runs paired by position (request index), sorted by
    arrival in the failure run."""
    return excess_series(failed, twin, metric).points()


def window_bounds(times: np.ndarray, half_s: float, min_n: int) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) per point, its window values[lo:hi]: the arrivals within ± half_s of the point's
    (`times` sorted), widened by index to hold at least min_n points. Both ends are non-decreasing."""
    n = len(times)
    h = min_n // 2
    i = np.arange(n)
    lo = np.searchsorted(times, times - half_s, side="left")  # the first arrival >= t − half_s
    hi = np.searchsorted(times, times + half_s, side="right")  # past the last arrival <= t + half_s
    lo = np.minimum(np.minimum(lo, np.maximum(0, i - h)), max(0, n - min_n))
    hi = np.maximum(np.maximum(hi, np.minimum(n, i + h + 1)), min(n, min_n))
    return lo, hi


class _Selector:
    """The k-th smallest of values[lo:hi] for any ranges of one array: a wavelet matrix over the
    values' ranks (stable, so equal values have distinct ranks), built in O(n log n); a query walks
    its log2(n) levels, all queries at once. NaN-free values; the answer is a value of the array."""

    def __init__(self, values: np.ndarray) -> None:
        n = len(values)
        order = np.argsort(values, kind="stable")
        self.sorted = values[order]
        cur: npt.NDArray[np.int64] = np.empty(n, np.int64)
        cur[order] = np.arange(n, dtype=np.int64)
        self.bits = max(1, (n - 1).bit_length())
        # per level, from the top bit down: zeros[i] = how many of the level's first i symbols have the
        # bit clear; the next level holds those first, then the rest (each group in its order)
        self.zeros: list[npt.NDArray[np.int64]] = []
        for b in range(self.bits - 1, -1, -1):
            one = (cur & (1 << b)) != 0
            zeros = np.zeros(n + 1, np.int64)
            np.cumsum(~one, out=zeros[1:])
            self.zeros.append(zeros)
            cur = np.concatenate((cur[~one], cur[one]))

    def kth(self, lo: np.ndarray, hi: np.ndarray, k: np.ndarray) -> np.ndarray:
        """values[lo:hi] sorted, entry k (0 <= k < hi − lo), for each query."""
        lo, hi, k = lo.astype(np.int64), hi.astype(np.int64), k.astype(np.int64)
        rank = np.zeros(len(k), np.int64)
        for zeros, b in zip(self.zeros, range(self.bits - 1, -1, -1), strict=True):
            z_lo, z_hi = zeros[lo], zeros[hi]
            clear = z_hi - z_lo  # symbols in the range with the bit clear
            right = k >= clear  # the k-th has the bit set: it is among the others
            k -= clear * right
            lo = np.where(right, lo - z_lo + zeros[-1], z_lo)
            hi = np.where(right, hi - z_hi + zeros[-1], z_hi)
            rank |= right.astype(np.int64) << b
        out: np.ndarray = self.sorted[rank]
        return out


def window_medians(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The median of values[lo[i]:hi[i]] for each i (every window non-empty, NaN-free values): the
    middle value, or `(a + b) / 2` of the two middle ones, exactly as a sorted list gives them."""
    if len(lo) == 0:
        return np.empty(0)
    base = int(lo.min())
    selector = _Selector(values[base : int(hi.max())])
    lo, hi = lo - base, hi - base
    m = hi - lo
    out = selector.kth(lo, hi, m // 2)
    even = np.flatnonzero(m % 2 == 0)
    if len(even):
        out[even] = (selector.kth(lo[even], hi[even], m[even] // 2 - 1) + out[even]) / 2
    return out


def rolling_median(values: Sequence[float], windows: Sequence[tuple[int, int]]) -> list[float]:
    """The median of values[lo:hi] for each (lo, hi); both ends must be non-decreasing."""
    n = len(values)
    if not windows:
        return []
    ends = np.array(windows, dtype=np.int64).reshape(len(windows), 2)
    lo, hi = ends[:, 0], ends[:, 1]
    back = np.flatnonzero((np.diff(lo, prepend=0) < 0) | (np.diff(hi, prepend=0) < 0))
    lo, hi = np.clip(lo, 0, n), np.clip(hi, 0, n)
    empty = np.flatnonzero(hi <= lo)
    if len(back) and (not len(empty) or back[0] <= empty[0]):
        raise ValueError("window ends must be non-decreasing")
    if len(empty):
        raise ValueError("empty window")
    out: list[float] = window_medians(np.asarray(values, dtype=np.float64), lo, hi).tolist()
    return out


def smoothed_series(
    series: ExcessSeries,
    params: RecoveryParams,
    metric: Metric = "ttft",
    start: int = 0,
    stop: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(smoothed excess, bound) for the points start..stop of `series`."""
    lo, hi = window_bounds(series.arrival, params.smooth_s / 2, params.min_requests)
    return _smoothed(series, lo[start:stop], hi[start:stop], params, metric)


def _smoothed(
    series: ExcessSeries, lo: np.ndarray, hi: np.ndarray, params: RecoveryParams, metric: Metric
) -> tuple[np.ndarray, np.ndarray]:
    s = window_medians(series.excess, lo, hi)
    ref = window_medians(series.reference, lo, hi)
    return s, np.maximum(params.floor(metric), params.bound_rel * ref)


def smoothed(
    points: Sequence[ExcessPoint], params: RecoveryParams, metric: Metric = "ttft"
) -> tuple[list[float], list[float]]:
    """(smoothed excess, bound) per point; `points` sorted by arrival."""
    s, bound = smoothed_series(ExcessSeries.of_points(points), params, metric)
    return s.tolist(), bound.tolist()


FIRST_CHUNK, MAX_CHUNK = 4096, 65536  # points smoothed at a time in `recovery_of` (doubling)


def recovery_of(
    series: ExcessSeries, failure_at: float, params: RecoveryParams | None = None, metric: Metric = "ttft"
) -> float | None:
    """Seconds from `failure_at` until the smoothed excess stays within its bound for `sustain_s`.

    The scan, one point at a time: from the first arrival at or after the failure, a point over its
    bound clears the start; a point within it sets the start (its arrival) when there is none (at
    first the start is the failure), and ends the scan when it arrived `sustain_s` or more after the
    start. Here in chunks, vectorised: a point's start is the failure when no point from the failure
    on was over its bound before it, else the arrival of the point after the last such one.
    """
    params = params or RecoveryParams()
    t, n = series.arrival, len(series)
    first = int(np.searchsorted(t, failure_at, side="left"))  # arrivals before the failure are skipped
    lo, hi = window_bounds(t, params.smooth_s / 2, params.min_requests)
    last_bad = first - 1  # the last point over its bound so far (first − 1: none)
    pos, chunk = first, FIRST_CHUNK
    while pos < n:
        end = min(n, pos + chunk)
        s, bound = _smoothed(series, lo[pos:end], hi[pos:end], params, metric)
        bad = s > bound
        last = np.maximum.accumulate(np.where(bad, np.arange(pos, end), last_bad))
        start = np.where(last < first, failure_at, t[np.minimum(last + 1, n - 1)])
        done = np.flatnonzero(~bad & (t[pos:end] >= start + params.sustain_s))
        if len(done):
            return float(start[done[0]]) - failure_at
        last_bad, pos, chunk = int(last[-1]), end, min(2 * chunk, MAX_CHUNK)
    return None


def recovery_from(
    points: Sequence[ExcessPoint],
    failure_at: float,
    params: RecoveryParams | None = None,
    metric: Metric = "ttft",
) -> float | None:
    """Seconds from `failure_at` until the smoothed excess stays within its bound for `sustain_s`
    (`points` sorted by arrival)."""
    return recovery_of(ExcessSeries.of_points(points), failure_at, params, metric)


def measure(
    failed: Records,
    twin: Records,
    failure_at: float,
    metric: Metric = "ttft",
    params: RecoveryParams | None = None,
) -> RecoveryMeasure:
    """Recovery time and damage of a failure run against its no-failure twin."""
    series = excess_series(failed, twin, metric)
    finite = series.excess[np.isfinite(series.excess)]
    return RecoveryMeasure(
        recovery_s=recovery_of(series, failure_at, params, metric),
        excess_request_s=math.fsum(finite.tolist()),
        lost=len(series) - len(finite),
        compared=len(series),
    )
