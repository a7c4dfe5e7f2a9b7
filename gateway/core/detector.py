"""Failure detection by silence: a per-worker adaptive detector and the cluster's verdict (DESIGN 4.3).

A worker's crash is seen at once by its broken streams (the shells do that); this module decides when
*silence* means failure. The fixed rule it replaces (FAILED after `misses` × `interval` without a
heartbeat, 60 ms by default) fenced healthy workers whenever other processes took the host's CPUs:
their heartbeats arrived 60–90 ms apart now and then. Here each worker's rule adapts to the jitter
its own heartbeats show, and a suspicion is confirmed by an independent probe before it is fenced.

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

**The confirmation** (`judge`): where the shell can probe a worker (Lumen's workers: an HTTP request
to its own server, a path independent of the heartbeat stream), a suspected worker is probed once,
and a silence past "fail after" is FAILED only when that probe has gone unanswered for
`probe_timeout_s` (or `pause_factor` × g, if longer), or was refused (the process is gone). A worker
whose process answers but whose heartbeats stay late is SUSPECT (alive, not serving), probed again
every probe timeout, and FAILED at the cap. Without a probe, "fail after" alone decides.

**The gateway's own stalls** are not the workers' silence: when the shell's detector tick runs late
(`gateway_stall`: GC, a busy event loop, a starved CPU), the lateness is forgiven to every worker
(`HeartbeatDetector.forgive`) before silences are measured; the probe, which goes through the
gateway's event loop too, is a second guard. When most workers still look dead in the same tick,
`silence_verdicts` blames the gateway first (`correlated_grace_s`).

Pure: no clock (times are passed in, seconds on any one clock), no I/O. The detector is a small
mutable object (a sliding window), deterministic in its inputs. The live monitor
(gateway/server/workers/monitor.py) and the simulator (gateway/sim/simulation.py, hang failures) both
decide with `silence_verdicts`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from statistics import NormalDist

from gateway.core.health import ALIVE_STATES, TRANSITIONS, WorkerState
from gateway.core.types import check

S = WorkerState

# before this many gaps are known, the detector assumes the nominal interval (μ = interval, σ = 0)
MIN_SAMPLES = 10
# recompute the window's sums exactly once per this many samples (bounds float drift)
_RESUM_EVERY = 4096
# every FAILED-by-silence reason starts with this (a supervisor reading /admin/events tells a hung
# worker from one whose stream broke by it)
SILENCE_REASON = "no heartbeat for"


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
        return replace(self, interval_s=interval_s, max_silence_s=max(self.max_silence_s, floor))


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
        suspect = max(2 * p.interval_s, mean + self._z_suspect * std, longest)
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


def host_pause(detectors: Iterable[HeartbeatDetector], now_s: float, interval_s: float) -> float:
    """The pause a worker with heartbeats every `interval_s` should expect from what its peers showed:
    its interval plus the longest excess over their own interval of their recent pauses. Workers
    sharing a host (or a gateway) stall together under CPU contention; one that has not happened to
    stall yet should not be the one fenced for it. Over-tolerant where they share nothing."""
    excess = max((d.recent_pause(now_s) - d.params.interval_s for d in detectors), default=0.0)
    return interval_s + max(0.0, excess)


def gateway_stall(prev_tick_s: float | None, now_s: float, period_s: float) -> float:
    """How much of the time since the detector's previous tick was the gateway's own stall: the whole
    lateness of this tick when it is more than half a period (less is the ordinary cost of a loop)."""
    if prev_tick_s is None:
        return 0.0
    late = now_s - prev_tick_s - period_s
    return late if late > period_s / 2 else 0.0


@dataclass(frozen=True, slots=True)
class Silence:
    """One worker as the verdict sees it: its state, how long it has been silent, its thresholds, the
    probe of this silence, and whether the shell can probe it at all."""

    state: WorkerState
    silence_s: float
    thresholds: Thresholds
    probe: Probe | None = None
    probeable: bool = False


@dataclass(frozen=True, slots=True)
class Verdict:
    state: WorkerState  # the worker's state after this tick (may equal its current one)
    probe: bool = False  # the shell should send the worker a probe now
    why: str = ""  # for the timeline, when the state changes


def _ms(s: float) -> str:
    return f"{1000 * s:.0f} ms"


def judge(s: Silence) -> Verdict:
    """One worker's verdict by silence (module docstring). Only live states change; a loading worker
    (JOINING, RESTARTING, DRAFT_READY) or a DRAINING one is never SUSPECT, only FAILED."""
    st, t, quiet = s.state, s.thresholds, s.silence_s
    if st not in ALIVE_STATES or quiet <= t.suspect_s:
        return Verdict(st)
    if quiet >= t.cap_s:
        return Verdict(S.FAILED, why=f"{SILENCE_REASON} {_ms(quiet)} (cap {_ms(t.cap_s)})")
    late = S.SUSPECT if st is S.SUSPECT or S.SUSPECT in TRANSITIONS[st] else st
    why = f"heartbeat late by {_ms(quiet)} (suspect after {_ms(t.suspect_s)}, fail after {_ms(t.fail_s)})"
    p = s.probe
    if not s.probeable:
        if quiet >= t.fail_s:
            return Verdict(S.FAILED, why=f"{SILENCE_REASON} {_ms(quiet)} (fail after {_ms(t.fail_s)})")
        return Verdict(late, why=why)
    if p is None:
        return Verdict(late, probe=True, why=why)
    if p.answered is False:
        return Verdict(S.FAILED, why=f"{SILENCE_REASON} {_ms(quiet)} and the probe was refused")
    if p.answered is True:
        # its process lives: late heartbeats, not a failure (until the cap); ask again now and then
        return Verdict(late, probe=p.sent_ago_s >= t.probe_s, why=why + "; the probe answered")
    if quiet >= t.fail_s and p.sent_ago_s >= t.probe_s:
        return Verdict(
            S.FAILED,
            why=f"{SILENCE_REASON} {_ms(quiet)} (fail after {_ms(t.fail_s)}) and no answer to a probe "
            f"for {_ms(p.sent_ago_s)}",
        )
    return Verdict(late, why=why)


def _refused(s: Silence) -> bool:
    return s.probe is not None and s.probe.answered is False


def silence_verdicts(silences: Mapping[str, Silence], correlated_grace_s: float) -> dict[str, Verdict]:
    """Every worker's verdict, guarding against the gateway being the slow one.

    When at least two and more than half of the live workers would be FAILED by silence in the same
    tick, the silence is more likely the gateway's own (a stalled event loop, a starved CPU, its own
    network) than half the cluster failing at once; those workers are SUSPECT until they have been
    silent for `correlated_grace_s`. A refused probe (the process is gone) is not held back, and
    crashes are still seen at once by their broken streams, which this does not delay.
    """
    out = {wid: judge(s) for wid, s in silences.items()}
    alive = [wid for wid, s in silences.items() if s.state in ALIVE_STATES]
    failing = [wid for wid in alive if out[wid].state is S.FAILED and not _refused(silences[wid])]
    if len(failing) >= 2 and 2 * len(failing) > len(alive):
        for wid in failing:
            s = silences[wid]
            if s.silence_s <= correlated_grace_s:
                held = S.SUSPECT if S.SUSPECT in TRANSITIONS[s.state] or s.state is S.SUSPECT else s.state
                out[wid] = Verdict(
                    held,
                    probe=s.probeable and s.probe is None,
                    why=f"{len(failing)} of {len(alive)} workers silent at once: the gateway is suspected first",
                )
    return out


def hang_detection_s(
    params: DetectorParams,
    *,
    phase_s: float = 0.0,
    tick_s: float | None = None,
    probeable: bool = True,
    correlated_grace_s: float = 1.0,
    others: int = 0,
    hung: int = 1,
) -> float:
    """Seconds from a hang (a process that stops, answering nothing) to FAILED, by the same verdict:
    `hung` workers with perfectly regular heartbeats (a full window of `interval_s` gaps) go silent at
    time 0, `phase_s` after their last beat, beside `others` that keep beating; the detector ticks
    every `tick_s` (default half an interval, as the live monitor). Used by the simulator."""
    p = params
    tick = tick_s if tick_s is not None else p.interval_s / 2
    det = HeartbeatDetector(p, 0.0)
    for k in range(1, p.window + 1):
        det.beat(k * p.interval_s)
    last = p.window * p.interval_s
    hang_at = last + phase_s
    t = hang_at
    thresholds = det.thresholds()
    steady = Silence(S.HEALTHY, 0.0, thresholds)
    states = [S.HEALTHY] * hung
    for _ in range(1_000_000):
        t += tick
        silences = {
            f"hung{i}": Silence(states[i], t - last, thresholds, det.probe(t), probeable) for i in range(hung)
        }
        silences.update({f"ok{i}": steady for i in range(others)})
        verdicts = silence_verdicts(silences, correlated_grace_s)
        first = verdicts["hung0"]
        if first.state is S.FAILED:
            return t - hang_at
        if first.probe:
            det.probe_sent(t)
        states = [verdicts[f"hung{i}"].state for i in range(hung)]
    raise AssertionError("a silent worker was never failed")  # unreachable: the cap fails it
