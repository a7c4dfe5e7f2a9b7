"""The poll rule (gateway/core/polls.py): a polled server's answers judged by the heartbeat detector in
units of its poll period, learned from its answer times; a poll's deadline; the patience a server
starts with; the verdict the agent asks for."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.detectorparams import DetectorParams
from gateway.core.health import WorkerState
from gateway.core.heartbeats import HeartbeatDetector
from gateway.core.polls import ANSWER_WINDOW, PollClock, poll_timeout_s, poll_verdict, prime

INTERVAL = 0.05
RULE = DetectorParams(interval_s=INTERVAL, misses=3)
S = WorkerState


def test_the_poll_period_is_the_interval_plus_the_median_answer() -> None:
    c = PollClock(INTERVAL)
    assert c.period_s() == INTERVAL and c.normal_answer_s() == 0.0
    for a in (0.2, 0.01, 0.3, 0.25):
        c.answered(a)
    assert c.normal_answer_s() == pytest.approx(0.225)  # median of 0.01, 0.2, 0.25, 0.3
    c.answered(-1.0)  # a clock step back counts as an instant answer
    assert c.normal_answer_s() == pytest.approx(0.2)
    for _ in range(ANSWER_WINDOW):
        c.answered(0.002)
    assert c.normal_answer_s() == pytest.approx(0.002) and c.answers == ANSWER_WINDOW
    assert c.params(RULE).interval_s == pytest.approx(INTERVAL + 0.002)
    with pytest.raises(ValueError):
        PollClock(0.0)


def feed(det: HeartbeatDetector, clock: PollClock, answers: list[float], t: float = 0.0) -> float:
    """Polls every INTERVAL after the previous answer, each answered after `answers[i]`."""
    for a in answers:
        t += INTERVAL + a
        clock.answered(a)
        det.retune(clock.params(RULE))
        det.beat(t)
    return t


def test_a_poll_waits_until_its_silence_would_fail_the_server() -> None:
    det = HeartbeatDetector(RULE, 0.0)
    clock = PollClock(INTERVAL)
    t = feed(det, clock, [0.2] * 40)
    th = det.thresholds(t)
    assert poll_timeout_s(th, 0.0, INTERVAL) == pytest.approx(th.fail_s)
    assert poll_timeout_s(th, th.fail_s - 0.1, INTERVAL) == pytest.approx(0.1)
    assert poll_timeout_s(th, th.fail_s + 1, INTERVAL) == INTERVAL  # never less than an interval
    # 200 ms answers learned: a poll is not cut at the old misses x interval (150 ms)
    assert th.fail_s > 3 * 0.25


def test_retune_keeps_what_the_detector_learned() -> None:
    det = HeartbeatDetector(RULE, 0.0)
    for k in range(1, 30):
        det.beat(k * 0.1)
    before = det.stats()
    det.retune(RULE.for_interval(0.3))
    assert det.stats() == before and det.samples == 29 and det.params.interval_s == 0.3


def test_a_new_server_starts_with_the_caps_patience_which_decays() -> None:
    det = HeartbeatDetector(RULE, 0.0)
    prime(det, 0.0)
    th = det.thresholds(0.0)
    assert th.fail_s == pytest.approx(RULE.max_silence_s) and th.suspect_s == pytest.approx(0.75)
    # a minute of ordinary answers later, half the patience is left; two minutes, a quarter
    assert det.thresholds(60.0).fail_s == pytest.approx(RULE.max_silence_s / 2)
    assert det.thresholds(120.0).fail_s == pytest.approx(RULE.max_silence_s / 4)


def test_a_new_incarnation_keeps_its_previous_ones_history() -> None:
    old = HeartbeatDetector(RULE, 0.0)
    t = 0.0
    for gap in [0.06] * 20 + [0.4]:
        t += gap
        old.beat(t)
    new = HeartbeatDetector(RULE, 10.0)
    prime(new, 10.0, old)
    assert new.samples == old.samples and new.stats() == old.stats()
    # a detector with gaps of its own does not inherit
    own = HeartbeatDetector(RULE, 0.0)
    own.beat(0.05)
    own.inherit(old, 0.05)
    assert own.samples == 1


def test_the_agents_verdict_is_the_gateways_rule() -> None:
    det = HeartbeatDetector(RULE, 0.0)
    clock = PollClock(INTERVAL)
    t = feed(det, clock, [0.005] * 200)
    th = det.thresholds(t)
    assert poll_verdict(det, t + th.suspect_s / 2).state is S.HEALTHY
    assert poll_verdict(det, t + (th.suspect_s + th.fail_s) / 2).state is S.SUSPECT
    v = poll_verdict(det, t + th.fail_s + 0.001)
    assert v.state is S.FAILED and v.why.startswith("no heartbeat for")


answers = st.lists(st.floats(min_value=0.0, max_value=0.6, allow_nan=False), min_size=1, max_size=300)


@settings(max_examples=200, deadline=None)
@given(answers)
def test_no_answer_time_the_server_has_shown_is_ever_suspected_or_failed(history: list[float]) -> None:
    """Whatever a primed server's answer times, a silence no longer than its longest gap so far (an
    answer as slow as one it gave) is never SUSPECT, let alone FAILED."""
    det = HeartbeatDetector(RULE, 0.0)
    prime(det, 0.0)
    clock = PollClock(INTERVAL)
    t = feed(det, clock, history)
    longest = INTERVAL + max(history)
    assert poll_verdict(det, t + longest).state is S.HEALTHY


@settings(max_examples=200, deadline=None)
@given(answers, st.floats(min_value=0.0, max_value=600.0))
def test_a_hung_server_is_failed_by_the_cap_whatever_it_showed(history: list[float], later: float) -> None:
    det = HeartbeatDetector(RULE, 0.0)
    prime(det, 0.0)
    clock = PollClock(INTERVAL)
    t = feed(det, clock, history) + later  # however long after its last answer it hangs...
    det.beat(t)
    cap = max(RULE.max_silence_s, RULE.misses * clock.period_s())
    assert poll_verdict(det, t + cap + 1e-3).state is S.FAILED  # ...past the cap it is FAILED
    assert poll_verdict(det, t + det.thresholds(t).fail_s + 1e-3).state is S.FAILED


def test_the_cap_is_at_least_misses_poll_periods() -> None:
    """An agent's rule (5 misses): answers of 1 s make 5 periods 5.5 s, and the cap follows (the bound
    docs/sglang.md states: max(max_silence_ms, misses poll periods) after the last answer)."""
    rule = DetectorParams(interval_s=0.1, misses=5)
    c = PollClock(0.1)
    for _ in range(10):
        c.answered(1.0)
    p = c.params(rule)
    assert p.interval_s == pytest.approx(1.1) and p.max_silence_s == pytest.approx(5.5)
    assert PollClock(0.1).params(rule).max_silence_s == rule.max_silence_s


def test_a_polled_server_is_suspected_no_sooner_than_four_periods() -> None:
    """An idle real SGLang server on a quiet host answered once 3.2 periods after the one before (173 ms
    at 53 ms) in 5 minutes: at a 2-period floor that was a SUSPECT (issue 27)."""
    from gateway.core.detectorparams import POLLED_SUSPECT_PERIODS, DetectorParams

    assert DetectorParams().suspect_periods == 2.0  # heartbeating workers keep theirs
    base = DetectorParams(misses=6)  # a failure floor past the suspicion's, so SUSPECT shows
    polled = base.for_interval(0.0534)
    assert polled.suspect_periods == POLLED_SUSPECT_PERIODS == 4.0
    det = HeartbeatDetector(polled, 0.0)
    t = 0.0
    for _ in range(2000):  # a steady idle server: answers 53.4 ms apart
        t += 0.0534
        det.beat(t)
    th = det.thresholds(t)
    assert th.suspect_s == pytest.approx(4 * 0.0534)
    assert poll_verdict(det, t + 0.173).state is S.HEALTHY  # the gap seen: no longer a suspicion
    assert poll_verdict(det, t + 0.22).state is S.SUSPECT
