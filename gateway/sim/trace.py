"""A simulation's gateway-side event trace, for replaying it through the live gateway's coordinator.

`TraceRecorder.attach(sim)` wraps the coordinator of a `Simulation` before it runs and records, in
order, what the live gateway would observe (worker loads as heartbeats would report them, arrivals,
ends, kills, state changes, the durable prefix holders report) and every decision the simulator
took from them (routing, holder choice and reassignment, recovery dispatch, draft-assist pairs, and
the outage admission: the recovery's start, batch-limit factor and end, and each worker's batch limit
and queue order as `SimOutage` applies them). The equivalence test feeds the same trace to the live
`LoadMonitor` / `CheckpointManager` / `SessionManager` / `DraftCoordinator` / `OutageAdmission` on a
fake clock and requires the same decisions: the two shells must keep the same books around the same
`gateway.core` functions.

The recorder only observes; a recorded run's results are the same as an unrecorded one's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.core.health import WorkerState
from gateway.sim.coordinator import Coordinator
from gateway.sim.outage import SimOutage
from gateway.sim.request import SimRequest
from gateway.sim.simulation import Simulation
from gateway.sim.worker import SimWorker, fifo_rank


@dataclass(frozen=True, slots=True)
class Attach:
    t: float
    worker: str
    kv_capacity_tokens: int
    ckpt_budget_bytes: int
    failure_domain: str


@dataclass(frozen=True, slots=True)
class Load:
    """What a heartbeat reports, plus requests routed to the worker that it has not reported yet."""

    t: float
    worker: str
    running: int
    waiting: int
    kv_tokens_used: int
    pending: int


@dataclass(frozen=True, slots=True)
class Route:
    t: float
    rid: int
    context: int
    remaining: int
    worker: str | None  # decision


@dataclass(frozen=True, slots=True)
class Attempt:
    t: float
    rid: int
    attempt: int
    serving: str
    context: int
    remaining: int
    holders: tuple[str, ...]  # decision


@dataclass(frozen=True, slots=True)
class Release:
    t: float
    rid: int
    # a request that completed: (prompt tokens, output tokens), what the gateway's sessions feed the
    # load's shape (core/loadshape.py); None for one that failed
    completed: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True)
class Kill:
    t: float
    worker: str


@dataclass(frozen=True, slots=True)
class State:
    t: float
    worker: str
    incarnation: int
    state: WorkerState


@dataclass(frozen=True, slots=True)
class Reassign:
    t: float
    rid: int
    attempt: int
    dead: str
    holders: tuple[str, ...]  # decision: the holders after reassignment


@dataclass(frozen=True, slots=True)
class Durable:
    t: float
    rid: int
    attempt: int
    holder: str
    tokens: int


@dataclass(frozen=True, slots=True)
class Recover:
    t: float
    rid: int
    failed: str
    context: int
    remaining: int
    action: str  # decision
    worker: str | None  # decision


@dataclass(frozen=True, slots=True)
class Pairs:
    t: float
    pairs: tuple[tuple[str, str], ...]  # decision: (drafter, target), sorted


@dataclass(frozen=True, slots=True)
class Outage:
    """The simulator's outage admission changed (gateway/sim/outage.py): a recovery started, its boost
    changed (more workers out at once) or it ended (`recovering` False, boost 1)."""

    t: float
    recovering: bool  # decision
    boost: float  # decision: the batch-limit factor (`outage_boost`)
    down_peak: int


@dataclass(frozen=True, slots=True)
class Admission:
    """What the simulator applied to one worker (every worker, the dead ones too, as `SimOutage`
    does): its batch limit and whether its queue is ordered shortest prefill first."""

    t: float
    worker: str
    incarnation: int
    limit: int  # decision: `admission_limit(base, boost)`
    shortest_first: bool  # decision


Event = (
    Attach
    | Load
    | Route
    | Attempt
    | Release
    | Kill
    | State
    | Reassign
    | Durable
    | Recover
    | Pairs
    | Outage
    | Admission
)


class TraceRecorder:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self._loads: dict[str, tuple[int, int, int, int]] = {}
        self._pairs: tuple[tuple[str, str], ...] = ()
        self._outage: tuple[bool, float] = (False, 1.0)
        self._admitted: dict[str, tuple[int, bool]] = {}
        self._now = 0.0

    def decisions(self) -> list[Event]:
        kinds = Route | Attempt | Reassign | Recover | Pairs | Outage | Admission
        return [e for e in self.events if isinstance(e, kinds)]

    def attach(self, sim: Simulation) -> None:
        """Record `sim`'s gateway side from now on (call before `sim.run()`)."""
        coord = sim.coord
        for w in coord.workers:
            self.events.append(Attach(0.0, w.id, w.kv_capacity, w.ckpt_budget_bytes, w.domain))
            self._admitted[w.id] = (w.max_running, w.rank_of is not fifo_rank)
        self._wrap(coord)
        self._wrap_outage(coord.outage)
        self._wrap_clock(sim)

    # -- wrappers -----------------------------------------------------------------------------------
    def _wrap(self, coord: Coordinator) -> None:
        route, start, release = coord.route, coord.start, coord.release
        freeze, set_state, holder_failed = coord.freeze, coord.set_state, coord.holder_failed
        recover, repair = coord.recover, coord.repair
        events = self.events

        def route_w(r: SimRequest, now: float) -> bool:
            self._now = now
            self._snapshot(coord)
            context, remaining = r.context, r.output - r.emitted
            ok = route(r, now)
            events.append(Route(now, r.rid, context, remaining, r.worker.id if ok and r.worker else None))
            return ok

        def start_w(r: SimRequest, w: SimWorker, now: float, restored: int) -> None:
            context, remaining = r.context, r.output - r.emitted
            start(r, w, now, restored)
            events.append(
                Attempt(now, r.rid, r.attempts, w.id, context, remaining, tuple(h.id for h in r.holders))
            )

        def release_w(r: SimRequest) -> None:
            release(r)
            if r.done:  # the request ended (a new attempt's release is part of its Attempt)
                done = None if r.error else (r.prompt, r.output)
                events.append(Release(self._now, r.rid, done))

        def freeze_w(w: SimWorker) -> None:
            self._snapshot(coord)  # the last load the gateway saw from it
            freeze(w)
            events.append(Kill(self._now, w.id))

        def set_state_w(w: SimWorker, state: WorkerState) -> None:
            set_state(w, state)
            events.append(State(self._now, w.id, w.incarnation, state))

        def holder_failed_w(dead: SimWorker, now: float) -> None:
            self._now = now
            self._snapshot(coord)
            affected = [(r, set(r.holders)) for r in sorted(dead.held, key=lambda r: r.rid)]
            holder_failed(dead, now)
            for r, before in affected:
                if set(r.holders) - before:  # given a new holder
                    events.append(Reassign(now, r.rid, r.attempts, dead.id, tuple(h.id for h in r.holders)))

        def recover_w(r: SimRequest, failed: SimWorker, now: float) -> bool:
            self._now = now
            self._snapshot(coord)
            for h in r.holders:
                events.append(Durable(now, r.rid, r.attempts, h.id, min(r.durable, r.context)))
            context, remaining = r.context, r.output - r.emitted
            before = dict(coord.decisions)
            ok = recover(r, failed, now)
            action = next((a for a, n in coord.decisions.items() if n != before.get(a, 0)), "replay")
            # recover() starts the new attempt itself; its Attempt event must follow the decision
            attempt = events.pop() if ok else None
            events.append(
                Recover(
                    now,
                    r.rid,
                    failed.id,
                    context,
                    remaining,
                    action,
                    r.worker.id if ok and r.worker else None,
                )
            )
            if attempt is not None:
                events.append(attempt)
            return ok

        def repair_w(now: float) -> None:
            self._now = now
            self._snapshot(coord)
            repair(now)
            pairs = tuple(sorted(coord.pairs.items()))
            if pairs != self._pairs:
                self._pairs = pairs
                events.append(Pairs(now, pairs))

        coord.route = route_w  # type: ignore[method-assign]
        coord.start = start_w  # type: ignore[method-assign]
        coord.release = release_w  # type: ignore[method-assign]
        coord.freeze = freeze_w
        coord.set_state = set_state_w  # type: ignore[method-assign]
        coord.holder_failed = holder_failed_w  # type: ignore[method-assign]
        coord.recover = recover_w  # type: ignore[method-assign]
        coord.repair = repair_w  # type: ignore[method-assign]

    def _wrap_clock(self, sim: Simulation) -> None:
        """Stamp the events of a kill, a detection and a reload phase with their own time (the
        coordinator's `freeze` and `set_state` are not told it)."""
        for name in ("_strike", "_detect", "_phase", "_restart_hung"):
            handler = getattr(sim, name)

            def stamped(*args: Any, _handler: Any = handler) -> None:
                self._now = args[-1]
                _handler(*args)

            setattr(sim, name, stamped)

    def _wrap_outage(self, outage: SimOutage) -> None:
        """Every batch limit and queue order `SimOutage` sets (all of them go through `_admit`, after
        `set_recovering` has re-ranked the queues) and the recovery's state and factor."""
        admit = outage._admit
        events = self.events

        def admit_w(now: float) -> int:
            limit = admit(now)
            state = (outage.recovering, outage.boost)
            if state != self._outage:
                self._outage = state
                events.append(Outage(now, outage.recovering, outage.boost, outage.down_peak))
            for w in outage.workers:
                applied = (w.max_running, w.rank_of is not fifo_rank)
                if applied != self._admitted[w.id]:
                    self._admitted[w.id] = applied
                    events.append(Admission(now, w.id, w.incarnation, *applied))
            return limit

        outage._admit = admit_w  # type: ignore[method-assign]

    def _snapshot(self, coord: Coordinator) -> None:
        """A Load event for every worker whose view changed since the last one."""
        for wid, v in coord.view().workers.items():
            load = (v.running, v.waiting, v.kv_tokens_used, v.pending)
            if self._loads.get(wid) != load:
                self._loads[wid] = load
                self.events.append(Load(self._now, wid, *load))


def as_dicts(events: list[Event]) -> list[dict[str, Any]]:
    """The trace as plain dicts (for JSON and readable assertion messages)."""
    out = []
    for e in events:
        d: dict[str, Any] = {"event": type(e).__name__}
        for k in e.__slots__:
            v = getattr(e, k)
            d[k] = v.value if isinstance(v, WorkerState) else v
        out.append(d)
    return out
