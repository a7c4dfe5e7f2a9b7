"""Worker state machine (failure detection by silence: test_core_detector.py)."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.core.health import (
        TRANSITIONS,
    IllegalTransition,
    Phase,
    WorkerState,
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


def test_restart_phases() -> None:
    assert state_for_phase(S.RESTARTING, Phase.LOADING_FULL) is S.RESTARTING
    assert state_for_phase(S.RESTARTING, Phase.DRAFT_READY) is S.DRAFT_READY
    assert state_for_phase(S.DRAFT_READY, Phase.SERVING) is S.HEALTHY
    assert state_for_phase(S.JOINING, Phase.LOADING_FULL) is S.JOINING
    assert state_for_phase(S.JOINING, Phase.SERVING) is S.HEALTHY
    assert state_for_phase(S.FAILED, Phase.SERVING) is S.FAILED
