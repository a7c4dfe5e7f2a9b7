"""Failure detection by silence (gateway/core/detector.py): the adaptive thresholds, the probe's
confirmation, the gateway's own stalls, the correlated-silence guard, and legal transitions."""

from __future__ import annotations

import math
import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.detector import (
    MIN_SAMPLES,
    DetectorParams,
    HeartbeatDetector,
    Probe,
    Silence,
    Thresholds,
    gateway_stall,
    hang_detection_s,
    host_pause,
    judge,
    silence_verdicts,
    z_of_phi,
)
from gateway.core.health import ALIVE_STATES, TRANSITIONS, WorkerState
from gateway.core.types import ParamError

S = WorkerState
P = DetectorParams()


def fed(gaps: list[float], params: DetectorParams = P) -> HeartbeatDetector:
    det = HeartbeatDetector(params, 0.0)
    t = 0.0
    for g in gaps:
        t += g
        det.beat(t)
    return det


def silent(det: HeartbeatDetector, silence: float, state: WorkerState = S.HEALTHY, **kw: object) -> Silence:
    return Silence(state, silence, det.thresholds(), **kw)  # type: ignore[arg-type]


def test_a_steady_worker_gets_the_tight_default_thresholds() -> None:
    det = fed([0.02] * 600)
    mean, std, _ = det.stats()
    assert mean == pytest.approx(0.02) and std == pytest.approx(0, abs=1e-6)
    t = det.thresholds()
    # σ' = 10 ms (half an interval): suspect at μ + 3.09σ' (φ = 3); fail at the larger of μ + 5.61σ'
    # (φ = 8, 76 ms) and 4 × the longest gap (80 ms)
    assert t.suspect_s == pytest.approx(0.02 + z_of_phi(3) * 0.01)
    assert t.fail_s == pytest.approx(max(0.02 + z_of_phi(8) * 0.01, P.pause_factor * 0.02))
    assert (round(t.suspect_s, 3), round(t.fail_s, 3), t.probe_s, t.cap_s) == (0.051, 0.08, 0.15, 3.0)
    assert det.phi(0.02 + z_of_phi(8) * 0.01) == pytest.approx(8, rel=1e-6)
    assert det.phi(t.suspect_s) == pytest.approx(3, rel=1e-6)


def test_before_enough_samples_the_nominal_interval_is_assumed() -> None:
    det = fed([0.02] * (MIN_SAMPLES - 1))
    assert det.stats() == (0.02, 0.0, pytest.approx(0.02))
    # the floors hold whatever the estimate says: never FAILED before misses x interval
    tight = DetectorParams(min_std_ratio=0.01, phi_suspect=0.5, phi_fail=0.5, pause_factor=1.0)
    assert fed([0.02] * 100, tight).thresholds().fail_s == pytest.approx(0.06)
    assert fed([0.02] * 100, tight).thresholds().suspect_s == pytest.approx(0.04)


def test_the_thresholds_follow_the_jitter_actually_observed() -> None:
    rnd = random.Random(1)
    steady = fed([0.02] * 500).thresholds()
    # a worker on a starved host: gaps of 20 ms with pauses of up to 90 ms now and then
    jittery = fed([0.09 if rnd.random() < 0.01 else rnd.uniform(0.018, 0.035) for _ in range(500)])
    t = jittery.thresholds()
    assert t.suspect_s >= 0.09 - 1e-9 > steady.fail_s  # a pause it has shown is not even suspected
    assert t.fail_s >= P.pause_factor * 0.09 - 1e-9
    # ... and they come back down once the pauses have left the window and their memory has faded
    calm = fed([0.09] * 5 + [0.02] * P.window)
    remembered = calm.thresholds()
    assert remembered.fail_s == pytest.approx(P.pause_factor * 0.09 * 0.5 ** (P.window * 0.02 / 60))
    got = calm.thresholds(calm.last_s + 10 * P.pause_half_life_s)
    assert (got.suspect_s, got.fail_s) == (pytest.approx(steady.suspect_s), pytest.approx(steady.fail_s))


def test_a_long_pause_is_remembered_beyond_the_window_halving_every_half_life() -> None:
    det = fed([0.02] * 100 + [0.5] + [0.02] * P.window)
    now = det.last_s
    age = P.window * 0.02
    assert det.stats()[2] == pytest.approx(0.02)  # out of the window
    assert det.pause(now) == pytest.approx(0.5 * 0.5 ** (age / P.pause_half_life_s))
    assert det.pause(now + P.pause_half_life_s) == pytest.approx(det.pause(now) / 2)
    assert det.recent_pause(now) == det.pause(now)


def test_pauses_of_the_other_workers_count_too() -> None:
    """Workers on one busy host stall together: the one that has not stalled yet is given the
    tolerance its peers earned (host_pause), in units of its own interval."""
    quiet = fed([0.02] * 200)
    stalled = fed([0.02] * 100 + [0.3] + [0.02] * 100)
    polled = fed([0.05] * 200, P.for_interval(0.05))
    now = max(quiet.last_s, stalled.last_s)
    peers = host_pause([quiet, stalled, polled], now, 0.02)
    assert peers == pytest.approx(stalled.recent_pause(now))
    assert host_pause([quiet, polled], now, 0.02) == pytest.approx(0.02)  # a slower poll is no pause
    alone, pooled = quiet.thresholds(now), quiet.thresholds(now, peers)
    assert pooled.fail_s == pytest.approx(P.pause_factor * peers)
    assert pooled.fail_s > alone.fail_s
    assert judge(Silence(S.SUSPECT, 0.5, pooled, Probe(0.5), True)).state is S.SUSPECT
    assert judge(Silence(S.SUSPECT, 0.5, alone, Probe(0.5), True)).state is S.FAILED


@settings(max_examples=60, deadline=None)
@given(
    st.floats(0.001, 1.0),  # interval
    st.lists(st.floats(0.0, 10.0), min_size=1, max_size=300),  # gaps, in intervals
    st.integers(2, 64),  # window
)
def test_window_statistics_are_those_of_the_last_window_gaps(interval, gaps, window) -> None:
    params = DetectorParams(interval_s=interval, window=window, max_silence_s=max(3.0, 3 * interval))
    det = fed([g * interval for g in gaps], params)
    last = [g * interval for g in gaps][-window:]
    mean, std, longest = det.stats()
    if len(last) < MIN_SAMPLES:
        assert (mean, std) == (interval, 0.0)
        assert longest == pytest.approx(max([interval, *last]), rel=1e-9)
    else:
        assert mean == pytest.approx(statistics.fmean(last), rel=1e-6, abs=1e-12)
        assert std == pytest.approx(statistics.pstdev(last), rel=1e-4, abs=1e-6 * interval)
        assert longest == pytest.approx(max(last), rel=1e-9)


jitter_histories = st.lists(
    st.one_of(st.floats(0.015, 0.04), st.floats(0.04, 0.4)), min_size=MIN_SAMPLES, max_size=400
)


@settings(max_examples=80, deadline=None)
@given(jitter_histories, st.floats(0.0, 1.0))
def test_a_worker_is_never_suspected_for_a_pause_it_has_shown_recently(history, fraction) -> None:
    """A steady worker with large jitter: a gap no longer than the longest in its window raises
    nothing, however large (up to the cap); not even SUSPECT, so it does not flap."""
    det = fed(history)
    longest = det.stats()[2]
    gap = fraction * longest
    for state in (S.HEALTHY, S.DEGRADED, S.RESTARTING):
        v = judge(silent(det, gap, state, probeable=True))
        assert v.state is state and not v.probe


@settings(max_examples=80, deadline=None)
@given(jitter_histories, st.floats(0.0, 5.0), st.booleans())
def test_failed_only_past_every_floor(history, silence, probeable) -> None:
    det = fed(history)
    t = det.thresholds()
    _, _, longest = det.stats()
    v = judge(silent(det, silence, probeable=probeable, probe=Probe(10.0) if probeable else None))
    if v.state is S.FAILED:
        assert silence >= min(t.cap_s, max(0.06, P.pause_factor * longest, t.fail_s))


@settings(max_examples=80, deadline=None)
@given(jitter_histories, st.sampled_from([S.HEALTHY, S.DEGRADED, S.JOINING, S.RESTARTING, S.DRAINING]))
def test_a_silent_worker_is_failed_within_its_bound(history, state) -> None:
    """A hung worker (no heartbeat, no probe answer) is FAILED by max(fail after, suspect after +
    probe wait) plus one tick, and never later than the cap plus one tick; without probes, by
    "fail after" plus one tick."""
    for probeable in (True, False):
        det = fed(history)
        t = det.thresholds()
        tick = P.interval_s / 2
        now, st_ = 0.0, state
        while True:
            now += tick
            v = judge(Silence(st_, now, t, det.probe(now), probeable))
            if v.probe:
                det.probe_sent(now)
            if v.state is S.FAILED:
                break
            assert v.state is st_ or v.state in TRANSITIONS[st_]
            st_ = v.state
            assert now <= t.cap_s + tick, (now, t)
        bound = max(t.fail_s, t.suspect_s + tick + t.probe_s) if probeable else t.fail_s
        assert now <= min(bound, t.cap_s) + 2 * tick, (now, t)


def test_a_probe_decides_between_late_and_dead() -> None:
    det = fed([0.02] * 500)
    t = det.thresholds()
    # suspected: SUSPECT, and a probe is asked for
    v = judge(silent(det, 0.06, probeable=True))
    assert v.state is S.SUSPECT and v.probe
    # past "fail after", but the probe is young: still SUSPECT
    v = judge(silent(det, 0.1, S.SUSPECT, probeable=True, probe=Probe(0.05)))
    assert v.state is S.SUSPECT and not v.probe
    # the probe unanswered for its wait: FAILED
    v = judge(silent(det, 0.21, S.SUSPECT, probeable=True, probe=Probe(t.probe_s)))
    assert v.state is S.FAILED and "no answer to a probe" in v.why
    # refused (the process is gone): FAILED as soon as it is suspected
    assert judge(silent(det, 0.055, S.SUSPECT, probeable=True, probe=Probe(0.001, False))).state is S.FAILED
    # answered: alive with late heartbeats; SUSPECT until the cap, asked again now and then
    v = judge(silent(det, 1.0, S.SUSPECT, probeable=True, probe=Probe(0.01, True)))
    assert v.state is S.SUSPECT and not v.probe
    v = judge(silent(det, 1.0, S.SUSPECT, probeable=True, probe=Probe(t.probe_s, True)))
    assert v.state is S.SUSPECT and v.probe
    assert judge(silent(det, 3.0, S.SUSPECT, probeable=True, probe=Probe(0.01, True))).state is S.FAILED
    # without a probe, "fail after" alone decides
    assert judge(silent(det, t.fail_s + 0.001, S.SUSPECT)).state is S.FAILED
    assert judge(silent(det, t.fail_s - 0.001, S.SUSPECT)).state is S.SUSPECT


@settings(max_examples=60, deadline=None)
@given(st.floats(0.03, 30.0), st.floats(0.0, 0.02))
def test_the_gateways_own_stall_is_not_blamed_on_anyone(stall, phase) -> None:
    """The detector's tick ran `stall` late (the gateway was descheduled); heartbeats queued
    meanwhile have not been read yet. The first tick after the stall raises nothing."""
    det = fed([0.02] * 500)
    last_tick = det.last_s + phase  # a tick on time, `phase` after the last beat
    now = last_tick + P.interval_s / 2 + stall
    forgiven = gateway_stall(last_tick, now, P.interval_s / 2)
    assert forgiven == pytest.approx(stall)
    det.forgive(forgiven)
    v = judge(silent(det, det.silence(now), probeable=True))
    assert v.state is S.HEALTHY and not v.probe


def test_an_ordinary_tick_forgives_nothing() -> None:
    assert gateway_stall(None, 5.0, 0.01) == 0.0
    assert gateway_stall(1.0, 1.0104, 0.01) == 0.0  # 0.4 ms late: the loop's ordinary cost
    assert gateway_stall(1.0, 1.03, 0.01) == pytest.approx(0.02)


def test_forgiveness_moves_an_outstanding_probe_too() -> None:
    det = fed([0.02] * 50)
    det.probe_sent(det.last_s + 0.06)
    det.forgive(0.5)
    probe = det.probe(det.last_s + 0.07)
    assert probe is not None and probe.sent_ago_s == pytest.approx(0.01)  # not 0.51
    det.beat(det.last_s + 0.07)  # a heartbeat ends the silence and its probe
    assert det.probe(det.last_s) is None


def test_correlated_silence_is_blamed_on_the_gateway_first() -> None:
    det = fed([0.02] * 500)

    def cluster(silences: dict[str, float], state: WorkerState = S.HEALTHY) -> dict[str, WorkerState]:
        got = silence_verdicts({w: silent(det, s, state) for w, s in silences.items()}, 1.0)
        return {w: v.state for w, v in got.items()}

    # one worker silent: failed as usual
    assert cluster({"a": 0.2, "b": 0.01, "c": 0.01}) == {"a": S.FAILED, "b": S.HEALTHY, "c": S.HEALTHY}
    # all silent for 200 ms at once: suspect, not failed
    assert set(cluster({w: 0.2 for w in "abc"}).values()) == {S.SUSPECT}
    # still silent after the grace: failed
    assert set(cluster({w: 1.5 for w in "abc"}, S.SUSPECT).values()) == {S.FAILED}
    # two of four is not a majority: both fail at once
    got = cluster({"a": 0.2, "b": 0.2, "c": 0.0, "d": 0.0})
    assert got["a"] is S.FAILED and got["b"] is S.FAILED
    # refused probes are not held back: those processes are gone
    got_v = silence_verdicts(
        {w: silent(det, 0.2, probeable=True, probe=Probe(0.01, False)) for w in "abc"}, 1.0
    )
    assert {v.state for v in got_v.values()} == {S.FAILED}


def test_a_correlated_suspicion_is_held_back_as_the_gateways_first() -> None:
    """Two idle real SGLang servers behind agents on a busy 2-core host were both late ~900 ms in one
    tick and both resumed at 947 ms (issue 27): a suspicion of most workers at once waits out the grace."""
    det = fed([0.02] * 500)
    t = det.thresholds()
    late = (t.suspect_s + t.fail_s) / 2  # past the suspicion, short of the failure

    def cluster(silences: dict[str, float], grace: float = 1.0) -> dict[str, WorkerState]:
        got = silence_verdicts({w: silent(det, s, S.HEALTHY) for w, s in silences.items()}, grace)
        return {w: v.state for w, v in got.items()}

    assert t.suspect_s < late < t.fail_s
    # one late worker of three: suspected as usual
    assert cluster({"a": late, "b": 0.0, "c": 0.0}) == {"a": S.SUSPECT, "b": S.HEALTHY, "c": S.HEALTHY}
    # two of two, or two of three, late at once: still HEALTHY within the grace
    assert cluster({"a": late, "b": late}) == {"a": S.HEALTHY, "b": S.HEALTHY}
    assert set(cluster({"a": late, "b": late, "c": 0.0}).values()) == {S.HEALTHY}
    # two of four is not a majority: both suspected
    assert cluster({"a": late, "b": late, "c": 0.0, "d": 0.0})["a"] is S.SUSPECT
    # past the grace: suspected
    assert set(cluster({"a": late, "b": late}, grace=late / 2).values()) == {S.SUSPECT}
    # a probeable worker held back is still probed, as a suspect would be
    held = silence_verdicts({w: silent(det, late, S.HEALTHY, probeable=True) for w in "ab"}, 1.0)
    assert all(v.state is S.HEALTHY and v.probe for v in held.values())


thresholds = st.builds(
    lambda a, b, c, d: Thresholds(min(a, b), max(a, b), c, max(a, b, d)),
    st.floats(0.0, 2.0),
    st.floats(0.0, 2.0),
    st.floats(0.0, 1.0),
    st.floats(0.0, 4.0),
)
probes = st.one_of(st.none(), st.builds(Probe, st.floats(0, 5), st.sampled_from([None, True, False])))
silences = st.builds(Silence, st.sampled_from(list(S)), st.floats(0, 5), thresholds, probes, st.booleans())


@given(st.dictionaries(st.text("abcd", min_size=1, max_size=2), silences), st.floats(0.01, 3))
def test_verdicts_are_legal_transitions(inputs, grace) -> None:
    for wid, v in silence_verdicts(inputs, grace).items():
        src = inputs[wid].state
        assert v.state is src or v.state in TRANSITIONS[src]
        if src not in ALIVE_STATES:
            assert v.state is src and not v.probe


def test_a_polled_server_is_judged_in_its_own_interval() -> None:
    polled = P.for_interval(0.05)
    assert polled.interval_s == 0.05 and polled.misses == P.misses
    t = fed([0.05] * 100, polled).thresholds()
    assert t.fail_s >= 0.15 and t.suspect_s >= 0.1
    assert P.for_interval(P.interval_s) is P


def test_parameters_are_bounded_and_name_the_field() -> None:
    for field, value in [
        ("interval_s", 0.0),
        ("misses", 0),
        ("window", 1),
        ("phi_suspect", 0.0),
        ("phi_fail", 1.0),
        ("min_std_ratio", 0.0),
        ("pause_factor", 0.5),
        ("pause_half_life_s", 0.0),
        ("probe_timeout_s", -0.1),
        ("max_silence_s", 0.01),
    ]:
        with pytest.raises(ParamError) as err:
            DetectorParams(**{field: value})  # type: ignore[arg-type]
        assert err.value.field == field
    with pytest.raises(ParamError):
        DetectorParams(probe_timeout_s=3.0, max_silence_s=3.0)


def test_hang_detection_by_the_shared_verdict() -> None:
    """The simulator's hang detection: the same verdict ticking on a silent worker."""
    quiet = hang_detection_s(P)
    t = fed([0.02] * 500).thresholds()
    assert t.suspect_s + t.probe_s <= quiet <= t.suspect_s + t.probe_s + 2 * P.interval_s / 2
    assert quiet < 0.3  # the quiet-host target for SIGSTOP
    assert hang_detection_s(P, probeable=False) == pytest.approx(t.fail_s, abs=P.interval_s / 2 + 1e-9)
    # most of the cluster silent at once: the gateway is suspected first (correlated_grace_s)
    assert hang_detection_s(P, hung=2, others=1) >= 1.0
    assert hang_detection_s(P, hung=1, others=2) == pytest.approx(quiet)
    assert math.isfinite(hang_detection_s(DetectorParams(probe_timeout_s=0.0)))
