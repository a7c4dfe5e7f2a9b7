"""Worker lifecycle states as the gateway sees them, and the legal transitions between them.

The table is data: an illegal transition raises, so a bug in the shell cannot silently put a worker
in a state the policies do not expect. When silence makes a worker SUSPECT or FAILED is
gateway/core/detector.py's verdict.
"""

from __future__ import annotations

import enum


class WorkerState(enum.Enum):
    JOINING = "JOINING"
    HEALTHY = "HEALTHY"
    SUSPECT = "SUSPECT"
    FAILED = "FAILED"
    RESTARTING = "RESTARTING"
    DRAFT_READY = "DRAFT_READY"
    DRAINING = "DRAINING"
    # alive and heartbeating but far slower than its peers (a gray failure, core/gray.py): no new
    # requests or checkpoints; its running requests are moved elsewhere
    DEGRADED = "DEGRADED"
    REMOVED = "REMOVED"


S = WorkerState

TRANSITIONS: dict[WorkerState, frozenset[WorkerState]] = {
    S.JOINING: frozenset({S.HEALTHY, S.FAILED, S.REMOVED}),
    S.HEALTHY: frozenset({S.SUSPECT, S.FAILED, S.DRAINING, S.DEGRADED}),
    S.DEGRADED: frozenset({S.HEALTHY, S.SUSPECT, S.FAILED, S.DRAINING, S.REMOVED}),
    # a suspect worker either heartbeats again or is declared failed
    S.SUSPECT: frozenset({S.HEALTHY, S.FAILED, S.DRAINING}),
    # a failed worker only comes back as a new incarnation, which starts by loading
    S.FAILED: frozenset({S.RESTARTING, S.HEALTHY, S.REMOVED}),
    S.RESTARTING: frozenset({S.DRAFT_READY, S.HEALTHY, S.FAILED, S.REMOVED}),
    S.DRAFT_READY: frozenset({S.HEALTHY, S.FAILED, S.REMOVED}),
    S.DRAINING: frozenset({S.REMOVED, S.FAILED}),
    S.REMOVED: frozenset(),
}

# states in which a worker may receive new requests or hold checkpoints
SERVING_STATES = frozenset({S.HEALTHY})
# states in which the worker process is believed alive (its streams are trusted)
ALIVE_STATES = frozenset(
    {S.JOINING, S.HEALTHY, S.SUSPECT, S.RESTARTING, S.DRAFT_READY, S.DRAINING, S.DEGRADED}
)


class IllegalTransition(ValueError):
    """Raised when the shell asks for a transition the table does not allow."""

    def __init__(self, src: WorkerState, dst: WorkerState) -> None:
        super().__init__(f"illegal worker transition {src.value} -> {dst.value}")
        self.src = src
        self.dst = dst


def can_transition(src: WorkerState, dst: WorkerState) -> bool:
    return dst in TRANSITIONS[src]


def transition(src: WorkerState, dst: WorkerState) -> WorkerState:
    """Return `dst` if `src -> dst` is legal, else raise IllegalTransition."""
    if dst not in TRANSITIONS[src]:
        raise IllegalTransition(src, dst)
    return dst


class Phase(enum.Enum):
    """What a worker reports about itself in its heartbeats."""

    LOADING_DRAFT = "LOADING_DRAFT"
    DRAFT_READY = "DRAFT_READY"
    LOADING_FULL = "LOADING_FULL"
    SERVING = "SERVING"
    DRAINING = "DRAINING"


def state_for_phase(current: WorkerState, phase: Phase) -> WorkerState:
    """The gateway state a heartbeat with `phase` moves a live worker to (may equal `current`)."""
    if current in (S.FAILED, S.REMOVED):
        return current
    if phase is Phase.SERVING:
        if current in (S.DRAINING, S.DEGRADED):  # the gateway's verdicts, not the worker's
            return current
        return S.HEALTHY
    if phase is Phase.DRAFT_READY:
        return S.DRAFT_READY if current in (S.RESTARTING, S.DRAFT_READY) else current
    if phase is Phase.DRAINING:
        return S.DRAINING if current in (S.HEALTHY, S.SUSPECT, S.DRAINING, S.DEGRADED) else current
    # loading phases: a first start stays JOINING, a restart stays RESTARTING
    return current
