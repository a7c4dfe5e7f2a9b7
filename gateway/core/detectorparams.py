"""The failure detector's parameters and their bounds (core/detector.py; config's [health] section).

One rule for every worker, in units of its nominal heartbeat interval: the floor of the old fixed rule
(`misses` × interval), the suspicion levels, the window and pause memory of the estimate
(core/heartbeats.py), the probe's wait and the cap past which silence alone fails a worker. A worker
polled at its own period (an SGLang server) gets the same rule for that period (`for_interval`). A bad
value raises ParamError naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from gateway.core.types import check

# A polled server (its answers are its heartbeats) is suspected after no fewer than this many poll
# periods of silence: an answer passes through the server's own HTTP stack, whose pauses a heartbeat
# task does not see. An idle real SGLang server on a quiet 2-core host answered once 173 ms after the
# one before (3.2 periods of 53 ms) in 5 minutes, and was SUSPECT at the 2-period floor (issue 27).
POLLED_SUSPECT_PERIODS = 4.0


@dataclass(frozen=True, slots=True)
class DetectorParams:
    interval_s: float = 0.020  # the worker's heartbeat period
    misses: int = 3  # FAILED never before misses × interval of silence (the old fixed rule, a floor)
    window: int = 1500  # inter-arrival times the estimate uses (30 s at 20 ms)
    phi_suspect: float = 3.0  # SUSPECT past φ = 3 (P(a gap that long) = 1e-3)
    phi_fail: float = 8.0  # FAILED past φ = 8 (Cassandra's and Akka's default convict level)
    min_std_ratio: float = 0.5  # σ' = max(σ, this × interval)
    # FAILED never before this × the longest gap in the window: under CPU contention a worker that
    # had shown 123 ms pauses stalled for ~360 ms once (docs/results.md, "Failure detection")
    pause_factor: float = 4.0
    # the longest pause is also remembered beyond the window, halving every this many seconds
    pause_half_life_s: float = 60.0
    probe_timeout_s: float = 0.15  # a suspicion's probe unanswered this long confirms it (0: no probes)
    max_silence_s: float = 3.0  # FAILED after this much silence, even if probes answer
    suspect_periods: float = 2.0  # SUSPECT never before this many heartbeat periods of silence

    def __post_init__(self) -> None:
        check(
            math.isfinite(self.interval_s) and self.interval_s > 0,
            "interval_s",
            self.interval_s,
            "must be > 0",
        )
        check(self.misses >= 1, "misses", self.misses, "must be >= 1")
        check(2 <= self.window <= 100_000, "window", self.window, "must be in 2..100000")
        check(0 < self.phi_suspect <= 12, "phi_suspect", self.phi_suspect, "must be in (0, 12]")
        check(
            self.phi_suspect <= self.phi_fail <= 12, "phi_fail", self.phi_fail, "must be in [phi_suspect, 12]"
        )
        check(self.min_std_ratio > 0, "min_std_ratio", self.min_std_ratio, "must be > 0")
        check(self.pause_factor >= 1, "pause_factor", self.pause_factor, "must be >= 1")
        check(
            math.isfinite(self.pause_half_life_s) and self.pause_half_life_s > 0,
            "pause_half_life_s",
            self.pause_half_life_s,
            "must be > 0",
        )
        check(
            math.isfinite(self.probe_timeout_s) and self.probe_timeout_s >= 0,
            "probe_timeout_s",
            self.probe_timeout_s,
            "must be >= 0 (0: no probes)",
        )
        check(
            math.isfinite(self.max_silence_s) and self.max_silence_s >= self.misses * self.interval_s,
            "max_silence_s",
            self.max_silence_s,
            "must be >= misses x interval",
        )
        check(
            math.isfinite(self.suspect_periods) and self.suspect_periods >= 1,
            "suspect_periods",
            self.suspect_periods,
            "must be >= 1",
        )
        check(
            self.probe_timeout_s < self.max_silence_s,
            "probe_timeout_s",
            self.probe_timeout_s,
            "must be < max_silence_s",
        )

    def for_interval(self, interval_s: float) -> DetectorParams:
        """The same rule for a worker with its own heartbeat period (a polled SGLang server)."""
        if interval_s == self.interval_s:
            return self
        floor = self.misses * interval_s
        return replace(
            self,
            interval_s=interval_s,
            max_silence_s=max(self.max_silence_s, floor),
            suspect_periods=max(self.suspect_periods, POLLED_SUSPECT_PERIODS),
        )
