"""Workloads: request arrival times and token lengths, generated or read from a trace.

The built-in generator is fitted to the Azure LLM inference trace (conversation service) lengths
(DESIGN 8): ln(length) is piecewise linear in the normal score through the trace's quantiles at
p1/p10/p25/p50/p75/p90/p95/p99/p99.9 ("piecewise lognormal"), so those match exactly (p50/p90/p99:
input 1020/2734/4142, output 129/424/601), extended with the end slopes and clipped to the trace's
range. A plain lognormal through p50/p90 misses p99 and the means; the trace is far from lognormal
(output p75 = 395 is near p90 = 424). Input and output lengths are drawn independently (their log-lengths
correlate at 0.09 in the trace). Arrivals are Poisson, or bursty: a gamma renewal process with the
given coefficient of variation of inter-arrival times (cv = 1 is Poisson).

The trace reader takes `TIMESTAMP, ContextTokens, GeneratedTokens` rows; times are made relative to
the first row and may be compressed by `speedup` (2.0 replays twice as fast).
"""

from __future__ import annotations

import csv
import itertools
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np

# the probabilities at which length distributions are pinned to a trace's quantiles
PROBS = (0.01, 0.10, 0.25, 0.50, 0.75, 0.90, 0.95, 0.99, 0.999)
_Z = np.array([NormalDist().inv_cdf(p) for p in PROBS])


@dataclass(frozen=True, slots=True)
class LengthFit:
    """A length distribution through given quantiles (at `PROBS`), clipped to [lo, hi].

    ln(length) is linear in the normal score between the quantiles and extended with the end slopes.
    """

    quantiles: tuple[float, ...]
    lo: int
    hi: int

    def __post_init__(self) -> None:
        q = self.quantiles
        if len(q) != len(PROBS) or q[0] <= 0 or any(b < a for a, b in itertools.pairwise(q)):
            raise ValueError(f"need {len(PROBS)} increasing positive quantiles, got {q}")
        if not 1 <= self.lo <= self.hi:
            raise ValueError(f"need 1 <= lo <= hi, got {self.lo}, {self.hi}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        z = rng.standard_normal(n)
        logs = np.log(np.asarray(self.quantiles, dtype=np.float64))
        y = np.interp(z, _Z, logs)
        lo_slope = (logs[1] - logs[0]) / (_Z[1] - _Z[0])
        hi_slope = (logs[-1] - logs[-2]) / (_Z[-1] - _Z[-2])
        y = np.where(z < _Z[0], logs[0] + lo_slope * (z - _Z[0]), y)
        y = np.where(z > _Z[-1], logs[-1] + hi_slope * (z - _Z[-1]), y)
        return np.clip(np.rint(np.exp(y)), self.lo, self.hi).astype(np.int64)


# Azure conv trace quantiles at PROBS (p50/p90/p99: input 1020/2734/4142, output 129/424/601)
CONV_INPUT = LengthFit((29, 207, 396, 1020, 1189, 2734, 4083, 4142, 6179), lo=2, hi=14050)
CONV_OUTPUT = LengthFit((16, 54, 85, 129, 395, 424, 451, 601, 954), lo=1, hi=1000)
CONV_RATE = 19366 / (58 * 60 + 22)  # requests per second over the trace's 58 min 22 s

# Other workload shapes (issue 17), synthetic on purpose (no other public trace): code-like (long
# prompts, ~30-token outputs; pair it with bursty arrivals, `workload.burst_cv`) and long-output chat
# (~2k-token prompts, ~450-token outputs). Quantiles at PROBS, chosen, not fitted to any trace.
CODE_INPUT = LengthFit((250, 700, 1300, 2000, 2700, 3600, 4300, 5800, 7600), lo=16, hi=8192)
CODE_OUTPUT = LengthFit((3, 8, 16, 28, 42, 62, 80, 130, 240), lo=1, hi=512)
LONG_OUTPUT = LengthFit((120, 240, 340, 440, 550, 680, 780, 1000, 1400), lo=16, hi=2048)
# workload.shape -> (prompt lengths, output lengths)
SHAPES: dict[str, tuple[LengthFit, LengthFit]] = {
    "conv": (CONV_INPUT, CONV_OUTPUT),
    "code": (CODE_INPUT, CODE_OUTPUT),
    "long_output": (CODE_INPUT, LONG_OUTPUT),
}


@dataclass(frozen=True, slots=True)
class Workload:
    """Requests sorted by arrival: times in seconds from 0, prompt and output lengths in tokens."""

    arrivals: np.ndarray
    prompts: np.ndarray
    outputs: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.arrivals)
        if len(self.prompts) != n or len(self.outputs) != n:
            raise ValueError("arrivals, prompts and outputs must have the same length")
        if n and (np.any(np.diff(self.arrivals) < 0) or self.arrivals[0] < 0):
            raise ValueError("arrivals must be sorted and >= 0")
        if n and (self.prompts.min() < 1 or self.outputs.min() < 1):
            raise ValueError("every request needs at least 1 prompt and 1 output token")

    def __len__(self) -> int:
        return len(self.arrivals)

    def head(self, duration_s: float) -> Workload:
        """The requests arriving before `duration_s`."""
        n = int(np.searchsorted(self.arrivals, duration_s, side="left"))
        return Workload(self.arrivals[:n], self.prompts[:n], self.outputs[:n])


def arrival_times(rng: np.random.Generator, rate: float, duration_s: float, cv: float = 1.0) -> np.ndarray:
    """Arrival instants in [0, duration): Poisson (cv = 1) or a gamma renewal process with that cv."""
    if not (rate > 0 and duration_s >= 0 and cv > 0):
        raise ValueError(f"need rate > 0, duration >= 0, cv > 0; got {rate}, {duration_s}, {cv}")
    shape = 1.0 / (cv * cv)
    chunks: list[np.ndarray] = []
    t = 0.0
    block = max(16, int(rate * duration_s * 1.1) + 16)
    while t < duration_s:
        gaps = (
            rng.gamma(shape, 1.0 / (rate * shape), block) if cv != 1.0 else rng.exponential(1 / rate, block)
        )
        times = t + np.cumsum(gaps)
        chunks.append(times)
        t = float(times[-1])
    out = np.concatenate(chunks) if chunks else np.zeros(0)
    return out[out < duration_s]


def synthetic(
    rng: np.random.Generator,
    rate: float,
    duration_s: float,
    cv: float = 1.0,
    inputs: LengthFit = CONV_INPUT,
    outputs: LengthFit = CONV_OUTPUT,
) -> Workload:
    """Conv-like requests at `rate` per second for `duration_s` seconds."""
    arrivals = arrival_times(rng, rate, duration_s, cv)
    n = len(arrivals)
    return Workload(arrivals, inputs.sample(rng, n), outputs.sample(rng, n))


def _timestamp(text: str) -> float:
    # the trace has 7 fractional digits, more than datetime parses: split them off
    base, _, frac = text.strip().partition(".")
    seconds = datetime.fromisoformat(base).timestamp()
    return seconds + (float("0." + frac) if frac else 0.0)


class TraceError(ValueError):
    """A trace that cannot be used; the message names the file (and the line, for a bad row)."""


TRACE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def read_trace(path: str | Path, speedup: float = 1.0) -> Workload:
    """A `TIMESTAMP, ContextTokens, GeneratedTokens` CSV as a workload starting at time 0.

    Raises TraceError naming the file: missing or unreadable, a header without those columns, a bad
    row (with its line number), no rows at all. Token counts of 0 count as 1; negative ones are errors.
    """
    if not speedup > 0:
        raise ValueError(f"speedup must be > 0, got {speedup}")
    times: list[float] = []
    prompts: list[int] = []
    outputs: list[int] = []
    try:
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            missing = [c for c in TRACE_COLUMNS if c not in (reader.fieldnames or ())]
            if missing:
                raise TraceError(
                    f"{path}:1: the header {reader.fieldnames} lacks column(s) {missing}; "
                    f"a trace needs {', '.join(TRACE_COLUMNS)}"
                )
            for row in reader:
                line = reader.line_num
                try:
                    t = _timestamp(row["TIMESTAMP"])
                    p, o = int(row["ContextTokens"]), int(row["GeneratedTokens"])
                except (ValueError, TypeError, AttributeError) as exc:
                    raise TraceError(f"{path}:{line}: bad trace row {row!r}: {exc}") from exc
                if p < 0 or o < 0:
                    raise TraceError(f"{path}:{line}: negative token count in {row!r}")
                times.append(t)
                prompts.append(max(1, p))
                outputs.append(max(1, o))
    except FileNotFoundError as exc:
        raise TraceError(f"{path}: trace file not found") from exc
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise TraceError(f"{path}: cannot read the trace: {exc}") from exc
    if not times:
        raise TraceError(f"{path}: the trace has no requests")
    at = np.asarray(times, dtype=np.float64)
    order = np.argsort(at, kind="stable")
    at = at[order]
    at = (at - at[0]) / speedup
    return Workload(at, np.asarray(prompts, np.int64)[order], np.asarray(outputs, np.int64)[order])


def rate_of(w: Workload) -> float:
    """Mean arrival rate (requests per second) over the workload's span."""
    if len(w) < 2:
        return math.nan
    return (len(w) - 1) / float(w.arrivals[-1] - w.arrivals[0])


def describe_trace(path: str | Path, speedup: float, w: Workload) -> dict[str, Any]:
    """What a report says about a trace workload: the file, the speedup, and what was replayed."""
    return {
        "source": "trace",
        "trace": str(path),
        "speedup": speedup,
        "requests": len(w),
        "span_s": round(float(w.arrivals[-1]), 2) if len(w) else 0.0,
        "rate_rps": _rounded(rate_of(w)),
    }


def describe_synthetic(shape: str, rate: float, burst_cv: float, w: Workload) -> dict[str, Any]:
    """What a report says about a generated workload: its shape, rate and burstiness."""
    return {
        "source": "synthetic",
        "shape": shape,
        "rate_rps": round(rate, 3),
        "burst_cv": burst_cv,
        "requests": len(w),
    }


def workload_label(info: dict[str, Any]) -> str:
    """One line naming the workload a report ran (`describe_trace` / `describe_synthetic` output)."""
    if info.get("source") == "trace":
        label = f"trace {info['trace']} at speedup {info['speedup']:g}"
        if info.get("calibrated_ttft_s") is not None:
            label += f" (calibrated to no-failure TTFT {info['calibrated_ttft_s']:g} s)"
        return label + f", {info['requests']} requests, {info['rate_rps']} req/s"
    label = (
        f"synthetic {info['shape']} workload at {info['rate_rps']} req/s (burst cv {info['burst_cv']:g}), "
        f"{info['requests']} requests"
    )
    if "warning" in info:
        label = f"**{info['warning']}** — {label}"
    return label


def _rounded(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 3)
