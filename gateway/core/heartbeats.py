"""One worker's heartbeats as the failure detector sees them (core/detector.py has the verdict).

**The estimate** (`HeartbeatDetector`): the inter-arrival times of a worker's last `window`
heartbeats give their mean μ, standard deviation σ and longest gap g. As in φ-accrual (Hayashibara et
al. 2004; Cassandra's and Akka's failure detectors), a silence of t seconds has suspicion level
φ(t) = −log10 P(a gap > t) under a normal law N(μ, σ'), σ' = max(σ, `min_std_ratio` × interval)
(Akka's minimum deviation: a very regular worker is not convicted by one late beat). φ crosses a
level φ* at t = μ + z(φ*)·σ', with z the normal quantile of 1 − 10^−φ*. Two thresholds follow:

- suspect after  max(2 × interval, μ + z(`phi_suspect`)·σ', g);
- fail after     max(`misses` × interval, μ + z(`phi_fail`)·σ', `pause_factor` × g, suspect).

The normal law underestimates heavy tails (a starved process shows rare long pauses, not a wider
bell), hence the terms in g: a silence no longer than pauses the worker has shown recently and
recovered from is not suspected at all, and is failed only at `pause_factor` times that. g is the
longest of the window's gaps, a memory of longer ones that halves every `pause_half_life_s`, and
what the shell passes as its other workers' recent pauses (`host_pause`: workers on one busy host
stall together, and the one that has not stalled yet should not be fenced for it). Both thresholds
are capped at `max_silence_s`, past which a worker is FAILED whatever else holds.

The detector also holds the probe of the current silence (sent when, answered how) and shifts its
clock forward by the gateway's own stalls (`forgive`). Pure: no clock (times are passed in, seconds
on any one clock), no I/O; a small mutable object (a sliding window), deterministic in its inputs.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from statistics import NormalDist

from gateway.core.detectorparams import DetectorParams

# before this many gaps are known, the detector assumes the nominal interval (μ = interval, σ = 0)
MIN_SAMPLES = 10
# recompute the window's sums exactly once per this many samples (bounds float drift)
_RESUM_EVERY = 4096


def z_of_phi(phi: float) -> float:
    """The normal quantile where the suspicion level is `phi`: P(Z > z) = 10^-phi."""
    return NormalDist().inv_cdf(1.0 - 10.0**-phi)


@dataclass(frozen=True, slots=True)
class Thresholds:
    """Silences (seconds) at which a worker is suspected and failed; the probe's wait; the cap."""

    suspect_s: float
    fail_s: float
    probe_s: float
    cap_s: float


@dataclass(frozen=True, slots=True)
class Probe:
    """The probe sent during the current silence: how long ago, and its answer so far (True: the
    worker's process answered; False: refused, the process is gone; None: no answer yet)."""

    sent_ago_s: float
    answered: bool | None = None


class HeartbeatDetector:
    """One worker's heartbeats as the detector sees them: the last arrival, a sliding window of
    inter-arrival times (mean, deviation, longest gap), and the probe of the current silence."""

    __slots__ = (
        "_count",
        "_gaps",
        "_maxq",
        "_pause",
        "_pause_at",
        "_stats",
        "_sum",
        "_sumsq",
        "_z_fail",
        "_z_suspect",
        "last_s",
        "params",
        "probe_answer",
        "probe_sent_s",
    )

    def __init__(self, params: DetectorParams, now_s: float) -> None:
        self.params = params
        self.last_s = now_s  # the last heartbeat (shifted forward by forgiven gateway stalls)
        self._gaps: deque[float] = deque()
        self._sum = 0.0
        self._sumsq = 0.0
        self._count = 0  # gaps ever recorded (indexes the max queue)
        self._maxq: deque[tuple[int, float]] = deque()  # (index, gap), gaps decreasing
        self._z_suspect = z_of_phi(params.phi_suspect)
        self._z_fail = z_of_phi(params.phi_fail)
        self._stats: tuple[float, float, float] | None = None
        self._pause = 0.0  # the longest gap, decaying with pause_half_life_s from when it was seen
        self._pause_at = now_s
        self.probe_sent_s: float | None = None
        self.probe_answer: bool | None = None

    # -- inputs -----------------------------------------------------------------------------------
    def beat(self, now_s: float) -> None:
        """A heartbeat arrived at `now_s`: one more gap, and the silence (and its probe) ends."""
        gap = now_s - self.last_s
        if gap >= 0:
            self._push(gap)
            self._pause = max(self.pause(now_s), gap)
            self._pause_at = now_s
            self.last_s = now_s
        self.probe_sent_s = None
        self.probe_answer = None

    def retune(self, params: DetectorParams) -> None:
        """Judge by `params` from now on, keeping the window and the pause memory (a polled server's
        period changes with its answer times: core/polls.py)."""
        if params == self.params:
            return
        if params.phi_suspect != self.params.phi_suspect or params.phi_fail != self.params.phi_fail:
            self._z_suspect = z_of_phi(params.phi_suspect)
            self._z_fail = z_of_phi(params.phi_fail)
        if params.window < len(self._gaps):
            raise ValueError("retune cannot shrink the window")
        self.params = params
        self._stats = None

    def remember_pause(self, gap_s: float, now_s: float) -> None:
        """Remember a pause of `gap_s` as if seen at `now_s` (decaying from then): a prior, or what
        another detector of the same process learned."""
        self._pause = max(self.pause(now_s), gap_s)
        self._pause_at = now_s

    def inherit(self, other: HeartbeatDetector, now_s: float) -> None:
        """Start from what `other` (an earlier incarnation of the same server) learned: its window of
        gaps and its pause memory. Only a detector with no gaps of its own inherits."""
        if self._gaps:
            return
        for gap in list(other._gaps)[-self.params.window :]:
            self._push(gap)
        self.remember_pause(other.pause(now_s), now_s)

    def forgive(self, stall_s: float) -> None:
        """The gateway itself stalled for `stall_s`: that time is nobody's silence."""
        if stall_s > 0:
            self.last_s += stall_s
            if self.probe_sent_s is not None:
                self.probe_sent_s += stall_s

    def probe_sent(self, now_s: float) -> None:
        self.probe_sent_s = now_s
        self.probe_answer = None

    def probe_answered(self, alive: bool) -> None:
        """The outstanding probe's answer (the shell drops answers to probes of an earlier silence)."""
        if self.probe_sent_s is not None:
            self.probe_answer = alive

    # -- outputs ----------------------------------------------------------------------------------
    def silence(self, now_s: float) -> float:
        return max(0.0, now_s - self.last_s)

    def probe(self, now_s: float) -> Probe | None:
        if self.probe_sent_s is None:
            return None
        return Probe(max(0.0, now_s - self.probe_sent_s), self.probe_answer)

    @property
    def samples(self) -> int:
        return len(self._gaps)

    def pause(self, now_s: float) -> float:
        """The longest gap seen, halved every `pause_half_life_s` since (a memory beyond the window)."""
        age = max(0.0, now_s - self._pause_at)
        decay: float = 0.5 ** (age / self.params.pause_half_life_s)
        return self._pause * decay

    def recent_pause(self, now_s: float) -> float:
        """The longest pause this worker has shown lately: the window's longest gap, or the decayed
        memory of a longer one."""
        return max(self.stats()[2], self.pause(now_s))

    def stats(self) -> tuple[float, float, float]:
        """(mean, standard deviation, longest gap) of the window; the nominal interval until
        MIN_SAMPLES gaps are known."""
        if self._stats is None:
            self._stats = self._compute_stats()
        return self._stats

    def _compute_stats(self) -> tuple[float, float, float]:
        p = self.params
        n = len(self._gaps)
        if n < MIN_SAMPLES:
            longest = self._maxq[0][1] if self._maxq else 0.0
            return p.interval_s, 0.0, max(p.interval_s, longest)
        mean = self._sum / n
        var = max(0.0, self._sumsq / n - mean * mean)
        return mean, math.sqrt(var), self._maxq[0][1]

    def thresholds(self, now_s: float | None = None, peer_pause_s: float = 0.0) -> Thresholds:
        """The silences at which this worker is suspected and failed at `now_s` (default: its last
        heartbeat). g is the longest of: the window's longest gap, the decayed memory of a longer one,
        and `peer_pause_s` (what the shell knows of pauses its other workers showed: `host_pause`)."""
        p = self.params
        mean, std, _ = self.stats()
        longest = max(self.recent_pause(self.last_s if now_s is None else now_s), peer_pause_s)
        std = max(std, p.min_std_ratio * p.interval_s)
        cap = p.max_silence_s
        suspect = max(p.suspect_periods * p.interval_s, mean + self._z_suspect * std, longest)
        fail = max(p.misses * p.interval_s, mean + self._z_fail * std, p.pause_factor * longest, suspect)
        probe = max(p.probe_timeout_s, p.pause_factor * longest)
        return Thresholds(min(suspect, cap), min(fail, cap), min(probe, cap), cap)

    def phi(self, silence_s: float) -> float:
        """The suspicion level of a silence: −log10 of the chance of a gap that long (normal law)."""
        p = self.params
        mean, std, _ = self.stats()
        std = max(std, p.min_std_ratio * p.interval_s)
        tail = 0.5 * math.erfc((silence_s - mean) / (std * math.sqrt(2.0)))
        return math.inf if tail <= 0 else -math.log10(tail)

    # -- the window -------------------------------------------------------------------------------
    def _push(self, gap: float) -> None:
        p = self.params
        gaps = self._gaps
        gaps.append(gap)
        self._sum += gap
        self._sumsq += gap * gap
        i = self._count
        self._count += 1
        maxq = self._maxq
        while maxq and maxq[-1][1] <= gap:
            maxq.pop()
        maxq.append((i, gap))
        if len(gaps) > p.window:
            old = gaps.popleft()
            self._sum -= old
            self._sumsq -= old * old
        while maxq[0][0] <= i - len(gaps):
            maxq.popleft()
        if self._count % _RESUM_EVERY == 0:
            self._sum = math.fsum(gaps)
            self._sumsq = math.fsum(g * g for g in gaps)
        self._stats = None
