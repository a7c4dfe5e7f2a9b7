"""Worker state machine and failure detection by silence."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.core.health import (
    ALIVE_STATES,
    TRANSITIONS,
    IllegalTransition,
    Phase,
    WorkerState,
    missed_heartbeat_state,
    state_for_phase,
    transition,
)

S = WorkerState


def test_documented_lifecycle_is_legal() -> None:
    path = [
        S.JOINING,
        S.HEALTHY,
        S.SUSPECT,
        S.HEALTHY,
        S.SUSPECT,
        S.FAILED,
        S.RESTARTING,
        S.DRAFT_READY,
        S.HEALTHY,
        S.DRAINING,
        S.REMOVED,
    ]
    for a, b in itertools.pairwise(path):
        assert transition(a, b) is b


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (S.FAILED, S.SUSPECT),
        (S.REMOVED, S.HEALTHY),
        (S.DRAFT_READY, S.SUSPECT),
        (S.HEALTHY, S.RESTARTING),
        (S.JOINING, S.DRAFT_READY),
    ],
)
def test_illegal_transitions_raise(src: WorkerState, dst: WorkerState) -> None:
    with pytest.raises(IllegalTransition, match=f"{src.value} -> {dst.value}"):
        transition(src, dst)


def test_removed_is_terminal() -> None:
    assert TRANSITIONS[S.REMOVED] == frozenset()


@given(st.sampled_from(list(S)), st.sampled_from(list(Phase)))
def test_phase_never_produces_an_illegal_transition(current: WorkerState, phase: Phase) -> None:
    dst = state_for_phase(current, phase)
    assert dst is current or dst in TRANSITIONS[current]


@given(st.sampled_from(list(S)), st.floats(0, 10), st.floats(0.001, 1), st.integers(1, 10))
def test_silence_never_produces_an_illegal_transition(current, since, interval, misses) -> None:
    dst = missed_heartbeat_state(current, since, interval, misses)
    assert dst is current or dst in TRANSITIONS[current]


def test_silence_thresholds_at_default_settings() -> None:
    interval, misses = 0.020, 3
    assert missed_heartbeat_state(S.HEALTHY, 0.019, interval, misses) is S.HEALTHY
    assert missed_heartbeat_state(S.HEALTHY, 0.031, interval, misses) is S.SUSPECT
    assert missed_heartbeat_state(S.SUSPECT, 0.059, interval, misses) is S.SUSPECT
    assert missed_heartbeat_state(S.SUSPECT, 0.061, interval, misses) is S.FAILED
    # a loading worker is FAILED by silence too, but never SUSPECT (it serves nothing)
    assert missed_heartbeat_state(S.RESTARTING, 0.031, interval, misses) is S.RESTARTING
    assert missed_heartbeat_state(S.RESTARTING, 0.061, interval, misses) is S.FAILED
    for dead in set(S) - ALIVE_STATES:
        assert missed_heartbeat_state(dead, 100.0, interval, misses) is dead


def test_restart_phases() -> None:
    assert state_for_phase(S.RESTARTING, Phase.LOADING_FULL) is S.RESTARTING
    assert state_for_phase(S.RESTARTING, Phase.DRAFT_READY) is S.DRAFT_READY
    assert state_for_phase(S.DRAFT_READY, Phase.SERVING) is S.HEALTHY
    assert state_for_phase(S.JOINING, Phase.LOADING_FULL) is S.JOINING
    assert state_for_phase(S.JOINING, Phase.SERVING) is S.HEALTHY
    assert state_for_phase(S.FAILED, Phase.SERVING) is S.FAILED


def test_correlated_silence_is_blamed_on_the_gateway_first() -> None:
    from gateway.core.health import silence_verdicts

    i, m, grace = 0.02, 3, 1.0
    # one worker silent: failed as usual
    v = silence_verdicts({"a": (S.HEALTHY, 0.2), "b": (S.HEALTHY, 0.01), "c": (S.HEALTHY, 0.01)}, i, m, grace)
    assert v == {"a": S.FAILED, "b": S.HEALTHY, "c": S.HEALTHY}
    # all silent for 200 ms at once: suspect, not failed
    v = silence_verdicts({w: (S.HEALTHY, 0.2) for w in "abc"}, i, m, grace)
    assert set(v.values()) == {S.SUSPECT}
    # still silent after the grace: failed
    v = silence_verdicts({w: (S.SUSPECT, 1.5) for w in "abc"}, i, m, grace)
    assert set(v.values()) == {S.FAILED}
    # two of four is not a majority: both fail at once
    v = silence_verdicts(
        {"a": (S.HEALTHY, 0.2), "b": (S.HEALTHY, 0.2), "c": (S.HEALTHY, 0), "d": (S.HEALTHY, 0)}, i, m, grace
    )
    assert v["a"] is S.FAILED and v["b"] is S.FAILED


@given(
    st.dictionaries(
        st.text("abcd", min_size=1, max_size=2), st.tuples(st.sampled_from(list(S)), st.floats(0, 5))
    ),
    st.floats(0.001, 0.5),
    st.integers(1, 5),
    st.floats(0.01, 3),
)
def test_silence_verdicts_are_legal_transitions(silences, interval, misses, grace) -> None:
    from gateway.core.health import silence_verdicts

    for wid, dst in silence_verdicts(silences, interval, misses, grace).items():
        src = silences[wid][0]
        assert dst is src or dst in TRANSITIONS[src]
