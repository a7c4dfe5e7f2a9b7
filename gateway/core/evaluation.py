"""The metrics of EVALUATION.md, one implementation for the simulator and the live load tests.

Recovery time against the no-failure twin (per-request excess, smoothed, sustained) and the damage
number are in `gateway.core.excess` (docs/evaluation.md); `windowed_recovery_time` here is
EVALUATION's original 2 s-window rule, kept for comparison.

Times are seconds on whichever clock produced the records (virtual or monotonic); every record of a
run, and both runs of a recovery comparison, must share it and its `origin` (the run's start).

Decisions on edge cases:
- TTFT and TPOT describe what clients received: a request that ended in an error contributes to the
  error count only. A request with fewer than 2 output tokens has no TPOT.
- A mean over no values is None, never 0.
- Recovery windows: a window where the no-failure run has no value is skipped (nothing to compare
  with) and does not count toward the 3 later windows. A window where the no-failure run has a value
  and the failure run has none (its requests all failed) is NOT recovered.
- Recovery is looked for from the window end at or before the failure onwards; if every window from
  the failure's own window on is within the bound, recovery time is 0. Too few (< 3) comparable
  windows after the last bad one: never recovered, None.
- The failure-impact window of a run that never recovered extends to the end of the run.

Every function that reads a run's records also takes them as `RecordArrays` (the same records as
columns, built once per run: the simulator's summaries read each run's several times) and computes on
the columns with numpy, with the same arithmetic as on the records one by one: the same values,
exactly (sums and means by `math.fsum`, which is exact whatever the order).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from operator import attrgetter
from typing import Literal

import numpy as np

Metric = Literal["ttft", "tpot"]


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request as its client saw it. `arrival` is the ORIGINAL arrival, even after a failover."""

    arrival: float
    first_token: float | None  # None: no token was received
    last_token: float | None
    output_tokens: int
    interrupted: bool = False  # in flight on a worker when it failed
    error: bool = False  # non-200 status or truncated stream
    # interrupted requests: last token before the failure to the first after it, when both exist
    resume_delay: float | None = None

    def __post_init__(self) -> None:
        if (self.first_token is None) != (self.last_token is None):
            raise ValueError("first_token and last_token must both be set or both be None")
        if self.output_tokens < 0:
            raise ValueError(f"output_tokens must be >= 0, got {self.output_tokens}")
        if self.first_token is not None and self.last_token is not None:
            if not self.arrival <= self.first_token <= self.last_token:
                raise ValueError(
                    f"need arrival <= first_token <= last_token, got "
                    f"{self.arrival}, {self.first_token}, {self.last_token}"
                )
            if self.output_tokens < 1:
                raise ValueError("a request with a first token has at least 1 output token")


def ttft(r: RequestRecord) -> float | None:
    if r.error or r.first_token is None:
        return None
    return r.first_token - r.arrival


def tpot(r: RequestRecord) -> float | None:
    """(last − first token time) / (output tokens − 1); None below 2 tokens or on error."""
    if r.error or r.first_token is None or r.last_token is None or r.output_tokens < 2:
        return None
    return (r.last_token - r.first_token) / (r.output_tokens - 1)


@dataclass(frozen=True, slots=True, eq=False)
class RecordArrays:
    """A run's records as columns: entry i of each array is record i's field, in the records' order.

    None is NaN in the float columns (a record's times are never NaN: `RequestRecord` checks them).
    """

    arrival: np.ndarray  # float64
    first_token: np.ndarray  # float64, NaN: None
    last_token: np.ndarray  # float64, NaN: None
    output_tokens: np.ndarray  # int64
    interrupted: np.ndarray  # bool
    error: np.ndarray  # bool
    resume_delay: np.ndarray  # float64, NaN: None

    @staticmethod
    def of(records: Iterable[RequestRecord] | RecordArrays) -> RecordArrays:
        """The records as columns (RecordArrays as they are)."""
        if isinstance(records, RecordArrays):
            return records
        rows = records if isinstance(records, Sequence) else list(records)
        n = len(rows)
        times = np.array(
            list(map(attrgetter("arrival", "first_token", "last_token", "resume_delay"), rows)),
            dtype=np.float64,
        )
        arrival, first, last, resume = times.reshape(n, 4).T.copy()
        return RecordArrays(
            arrival,
            first,
            last,
            np.fromiter(map(attrgetter("output_tokens"), rows), np.int64, n),
            np.fromiter(map(attrgetter("interrupted"), rows), np.bool_, n),
            np.fromiter(map(attrgetter("error"), rows), np.bool_, n),
            resume,
        )

    def __len__(self) -> int:
        return len(self.arrival)

    def metric(self, metric: Metric) -> np.ndarray:
        """`ttft` or `tpot` of every record (float64), NaN where it is None."""
        if metric == "ttft":
            return np.where(self.error, np.nan, self.first_token - self.arrival)
        valid = (
            ~self.error & (self.output_tokens >= 2) & ~np.isnan(self.first_token) & ~np.isnan(self.last_token)
        )
        span = np.where(valid, self.last_token - self.first_token, np.nan)
        return span / np.where(valid, self.output_tokens - 1, 1)

    def records(self) -> tuple[RequestRecord, ...]:
        """The records again: equal to those the arrays were made of."""
        out = []
        for a, f, last, n, i, e, d in zip(
            self.arrival.tolist(),
            self.first_token.tolist(),
            self.last_token.tolist(),
            self.output_tokens.tolist(),
            self.interrupted.tolist(),
            self.error.tolist(),
            self.resume_delay.tolist(),
            strict=True,
        ):
            out.append(
                RequestRecord(
                    a, None if f != f else f, None if last != last else last, n, i, e, None if d != d else d
                )
            )
        return tuple(out)


Records = Iterable[RequestRecord] | RecordArrays


def mean(values: Iterable[float | None]) -> float | None:
    """Mean of the values that exist; None when none do."""
    present = [v for v in values if v is not None]
    return math.fsum(present) / len(present) if present else None


def mean_present(values: np.ndarray) -> float | None:
    """`mean` of an array with NaN for None: the same value (fsum is exact, whatever the order)."""
    present = values[~np.isnan(values)].tolist()
    return math.fsum(present) / len(present) if present else None


def mean_metric(records: Records, metric: Metric) -> float | None:
    """Cluster TTFT or TPOT: the mean over requests that have one."""
    return mean_present(RecordArrays.of(records).metric(metric))


@dataclass(frozen=True, slots=True)
class Outcomes:
    total: int
    completed: int  # errors + completed == total
    errors: int
    interrupted: int


def outcomes(records: Records) -> Outcomes:
    a = RecordArrays.of(records)
    total, errors = len(a), int(np.count_nonzero(a.error))
    return Outcomes(total, total - errors, errors, int(np.count_nonzero(a.interrupted)))


def window_means(
    records: Records, metric: Metric, origin: float = 0.0, window_s: float = 2.0
) -> tuple[float | None, ...]:
    """m(t) per arrival window [origin + k·w, origin + (k+1)·w); None for a window with no value."""
    if not window_s > 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    a = RecordArrays.of(records)
    if len(a) == 0:
        return ()
    early = np.flatnonzero(~(a.arrival >= origin))  # NaN included: no window holds it
    if len(early):
        raise ValueError(f"arrival {a.arrival[early[0]]} is before the run's origin {origin}")
    k = np.floor((a.arrival - origin) / window_s)
    values = a.metric(metric)
    present = ~np.isnan(values)
    order = np.argsort(k[present], kind="stable")
    keys, grouped = k[present][order], values[present][order].tolist()
    n = int(k.max()) + 1
    ends = np.searchsorted(keys, np.arange(n + 1, dtype=np.float64), side="left").tolist()
    return tuple(math.fsum(grouped[lo:hi]) / (hi - lo) if hi > lo else None for lo, hi in pairwise(ends))


def windowed_recovery_time(
    failed: Records,
    baseline: Records,
    failure_at: float,
    metric: Metric = "ttft",
    origin: float = 0.0,
    window_s: float = 2.0,
    slack: float = 1.1,
    min_windows: int = 3,
) -> float | None:
    """EVALUATION's original windowed rule (kept for comparison; recovery time proper is the
    twin-based measure of gateway/core/excess.py): seconds from `failure_at` until m(t) stays within
    `slack` × the no-failure run's m(t).

    Recovery ends at the first window end e_j (from the one at or before the failure on) after which
    every comparable window is within the bound and there are at least `min_windows` of them.
    """
    if failure_at < origin:
        raise ValueError(f"failure_at {failure_at} is before the run's origin {origin}")
    got = window_means(failed, metric, origin, window_s)
    ref = window_means(baseline, metric, origin, window_s)
    first = math.floor((failure_at - origin) / window_s)  # the window the failure falls in
    # the bound holds after e_j iff j >= the last bad window, so the answer is max(last bad, first − 1)
    last_bad = first - 1
    comparable: list[int] = []
    for k in range(first, max(len(got), len(ref))):
        base = ref[k] if k < len(ref) else None
        if base is None:
            continue
        comparable.append(k)
        value = got[k] if k < len(got) else None
        if value is None or value > slack * base:
            last_bad = k
    if sum(1 for k in comparable if k > last_bad) < min_windows:
        return None
    return max(0.0, origin + (last_bad + 1) * window_s - failure_at)


@dataclass(frozen=True, slots=True)
class Impact:
    mean_ttft: float | None
    mean_tpot: float | None
    requests: int  # arriving in the window, errors included


def failure_impact(records: Records, failure_at: float, recovery_s: float | None) -> Impact:
    """Means over requests arriving in [failure, failure + recovery] (to the end if never recovered)."""
    a = RecordArrays.of(records)
    end = math.inf if recovery_s is None else failure_at + recovery_s
    inside = (failure_at <= a.arrival) & (a.arrival <= end)
    ttft_in, tpot_in = a.metric("ttft")[inside], a.metric("tpot")[inside]
    return Impact(mean_present(ttft_in), mean_present(tpot_in), int(np.count_nonzero(inside)))


def checkpoint_coverage(has_live_checkpoint: Iterable[bool]) -> float | None:
    """Share of in-flight requests with a live checkpoint; None with nothing in flight."""
    flags = list(has_live_checkpoint)
    return sum(flags) / len(flags) if flags else None


def holder_balance(tokens_per_holder: Iterable[int]) -> float | None:
    """max/min checkpointed tokens over holders (pass every eligible holder, empty ones included).

    None with no holders; 1.0 when all hold nothing; inf when some hold nothing and others hold some.
    """
    tokens = list(tokens_per_holder)
    if not tokens:
        return None
    hi, lo = max(tokens), min(tokens)
    if hi == 0:
        return 1.0
    return math.inf if lo == 0 else hi / lo
