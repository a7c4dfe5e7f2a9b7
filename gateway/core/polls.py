"""Failure detection of a polled server: its answers are its heartbeats (core/detector.py's rule).

An SGLang server says nothing by itself; the gateway (agentless, gateway/server/workers/sglang.py) or
the sidecar agent (worker_hooks/sglang/agent.py) polls it, and each answered poll is a heartbeat. The
time between two answers is then the poll interval plus the server's *answer time*, which is not
small and not steady: idle real servers on a busy 2-core machine took 190–270 ms to answer, and under
load longer (issue 27). Judged in units of the poll interval alone, with each poll cut at a fixed
`misses` × interval, those answers were misses: SUSPECT flapped on idle servers, and the agent
declared a healthy server lost when `/ready` took 619 ms.

So the rule is the heartbeat detector's (`HeartbeatDetector`, `judge`), in units of the server's
*poll period*: the poll interval plus its normal answer time, learned from its answers (`PollClock`:
the median of the last `ANSWER_WINDOW` answer times; a hung server answers nothing, so a hang never
teaches it patience). Every floor of the rule scales with that period (`POLLED_SUSPECT_PERIODS`, 4, before SUSPECT,
`misses` periods before FAILED, the minimum deviation), the window's mean, deviation and longest gap
follow the answers themselves, and the cap bounds it all: a hung server is FAILED once its silence
passes the fail threshold, and never later than max(`max_silence_s` (3 s by default), `misses`
periods) after its last answer.

A poll is allowed to wait for its answer until the silence it ends would be a failure anyway
(`poll_timeout_s`): a slow answer is a late heartbeat, not a missed one.

`poll_verdict` is the decision for a shell that keeps no worker states of its own (the agent: is the
server lost?); the gateway's monitor judges its records with the same `judge`, through
`silence_verdicts`, on the detector the poller retunes (`HeartbeatDetector.retune`). Pure: no clock,
no I/O.
"""

from __future__ import annotations

from collections import deque

from gateway.core.detector import Silence, Verdict, judge
from gateway.core.detectorparams import DetectorParams
from gateway.core.health import WorkerState
from gateway.core.heartbeats import HeartbeatDetector, Thresholds

# the detector's names a shell of polls needs (the SGLang agent imports them from here only)
__all__ = [
    "ANSWER_WINDOW",
    "DetectorParams",
    "HeartbeatDetector",
    "PollClock",
    "poll_timeout_s",
    "poll_verdict",
    "prime",
]

# answer times the normal one is the median of (about 6 s of polls at 50 ms on a quiet host)
ANSWER_WINDOW = 64


class PollClock:
    """What a poller learns of one server: its answer times, and from them its poll period."""

    __slots__ = ("_answers", "_sorted", "interval_s")

    def __init__(self, interval_s: float) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, not {interval_s}")
        self.interval_s = interval_s
        self._answers: deque[float] = deque(maxlen=ANSWER_WINDOW)
        self._sorted: list[float] | None = None

    def answered(self, answer_s: float) -> None:
        """A poll sent `answer_s` seconds before its answer came (negative clock steps count as 0)."""
        self._answers.append(max(0.0, answer_s))
        self._sorted = None

    @property
    def answers(self) -> int:
        return len(self._answers)

    def normal_answer_s(self) -> float:
        """The median of the recent answer times (0 before any answer)."""
        if not self._answers:
            return 0.0
        if self._sorted is None:
            self._sorted = sorted(self._answers)
        s = self._sorted
        n = len(s)
        return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2

    def period_s(self) -> float:
        """The server's poll period: the interval between polls plus its normal answer time."""
        return self.interval_s + self.normal_answer_s()

    def params(self, base: DetectorParams) -> DetectorParams:
        """The detector's rule for this server, in units of its poll period. Its cap is
        max(`max_silence_s`, `misses` periods) (`DetectorParams.for_interval`): a server whose answers
        take ~1 s is not failed by a 3 s cap under its own floor of `misses` periods. (Capping the
        period at cap / misses instead failed healthy real servers behind agents at load ~14.)"""
        return base.for_interval(self.period_s())


def prime(det: HeartbeatDetector, now_s: float, earlier: HeartbeatDetector | None = None) -> None:
    """A polled server's detector as it attaches: what an earlier detector of the same server learned
    (`earlier`, its previous incarnation's), and the prior that a server not yet known is slow: a
    remembered pause of `max_silence_s / pause_factor`, so its first fail threshold is the cap and
    its suspect threshold a quarter of it, both coming down (the memory halves every
    `pause_half_life_s`) as its own answers show what is normal. On a busy 2-core machine an idle real
    server that had answered in ~100 ms for 4 s stalled 396 ms: a fresh detector had failed it."""
    if earlier is not None:
        det.inherit(earlier, now_s)
    p = det.params
    det.remember_pause(p.max_silence_s / p.pause_factor, now_s)


def poll_timeout_s(thresholds: Thresholds, silence_s: float, interval_s: float) -> float:
    """How long a poll sent now, `silence_s` after the server's last answer, may wait for its answer:
    until that silence reaches the fail threshold (an answer later than that comes after the verdict),
    and at least one poll interval."""
    return max(interval_s, thresholds.fail_s - silence_s)


def poll_verdict(det: HeartbeatDetector, now_s: float, state: WorkerState = WorkerState.HEALTHY) -> Verdict:
    """The verdict on a polled server's silence at `now_s` (no probe: its polls are the probes):
    FAILED once the silence passes its fail threshold (or the cap), SUSPECT once it passes its
    suspect threshold. `det` is the server's detector, fed its answers and retuned to its period."""
    return judge(Silence(state, det.silence(now_s), det.thresholds(now_s)))
