"""Failure detection by silence: the cluster's verdict on its workers' silences (DESIGN 4.3).

A worker's crash is seen at once by its broken streams (the shells do that); this module decides when
*silence* means failure. The fixed rule it replaces (FAILED after `misses` × `interval` without a
heartbeat, 60 ms by default) fenced healthy workers whenever other processes took the host's CPUs:
their heartbeats arrived 60–90 ms apart now and then. Here each worker's rule adapts to the jitter
its own heartbeats show, and a suspicion is confirmed by an independent probe before it is fenced.

The parts, each pure:

- core/detectorparams.py: `DetectorParams`, the rule's parameters and their bounds;
- core/heartbeats.py: `HeartbeatDetector`, one worker's estimate (φ-accrual over a sliding window of
  its heartbeat gaps, with a memory of its pauses) and the silences at which it is suspected and
  failed (`Thresholds`), and the probe of its current silence (`Probe`);
- this module: what the shell passes across workers (`host_pause`, `gateway_stall`), the verdict on
  each worker's silence (`judge`) and on all of them at once (`silence_verdicts`), and the time a
  hang takes to be failed by that verdict (`hang_detection_s`, for the simulator). The names of the
  other two are re-exported here.

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

Pure: no clock (times are passed in, seconds on any one clock), no I/O. The live monitor
(gateway/server/workers/detection.py) and the simulator (gateway/sim/simulation.py, hang failures)
both decide with `silence_verdicts`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gateway.core.detectorparams import DetectorParams
from gateway.core.health import ALIVE_STATES, TRANSITIONS, WorkerState
from gateway.core.heartbeats import MIN_SAMPLES, HeartbeatDetector, Probe, Thresholds, z_of_phi

__all__ = [
    "MIN_SAMPLES",
    "SILENCE_REASON",
    "DetectorParams",
    "HeartbeatDetector",
    "Probe",
    "Silence",
    "Thresholds",
    "Verdict",
    "gateway_stall",
    "hang_detection_s",
    "host_pause",
    "judge",
    "silence_verdicts",
    "z_of_phi",
]

S = WorkerState

# every FAILED-by-silence reason starts with this (a supervisor reading /admin/events tells a hung
# worker from one whose stream broke by it)
SILENCE_REASON = "no heartbeat for"


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

    The same guard holds back a suspicion: when at least two and more than half of the live workers
    would turn from HEALTHY to SUSPECT in the same tick, they stay HEALTHY (probed as a suspect would
    be) until they have been silent for `correlated_grace_s`. Seen against real SGLang servers on a
    busy 2-core host (issue 27): two idle servers' answers both ~900 ms late in one tick, both resumed
    at 947 ms; alone, each is a suspicion; together, they are the host's stall. A suspicion only takes a
    worker out of routing, so holding it back costs at most `correlated_grace_s` of routing to a worker
    that may be hung, and a hang still fails on the rule above.
    """
    out = {wid: judge(s) for wid, s in silences.items()}
    alive = [wid for wid, s in silences.items() if s.state in ALIVE_STATES]
    suspecting = [wid for wid in alive if silences[wid].state is S.HEALTHY and out[wid].state is S.SUSPECT]
    if len(suspecting) >= 2 and 2 * len(suspecting) > len(alive):
        for wid in suspecting:
            if silences[wid].silence_s <= correlated_grace_s:
                out[wid] = Verdict(
                    S.HEALTHY,
                    probe=out[wid].probe,
                    why=f"{len(suspecting)} of {len(alive)} workers late at once: the gateway is suspected first",
                )
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
