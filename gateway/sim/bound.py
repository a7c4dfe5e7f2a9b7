"""The capacity bound (failure kind `capacity`, docs/evaluation.md): a failure that takes only a
worker's capacity for its reload, so that a mode's distance from it is what a better checkpoint,
restore or detection could still win."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.core.health import WorkerState as S
from gateway.sim.request import SimRequest
from gateway.sim.worker import SimWorker

if TYPE_CHECKING:
    from gateway.sim.simulation import Simulation


def vanish(sim: Simulation, victims: list[SimWorker], now: float) -> None:
    """The capacity bound: each victim's capacity is gone for its reload, starting now, and nothing
    else is lost. What it was running completes at once (a request not yet prefilled gets its
    first token now, earlier than in the twin, where it had none by now either); what waited in
    its queue is routed afresh, once the recovery (its queue order and batch limits) has begun.
    No request is interrupted and nothing waits for detection: what a recovery could at best
    reach with the same reload (a reference, not a theorem: docs/evaluation.md)."""
    sim.reloads.struck(victims, now)
    again: list[SimRequest] = []
    for w in victims:
        queued = set(w.waiting)
        taken = w.kill(now)
        w.lost, w.lost_at_kill = [], 0
        again += [r for r in taken if r in queued]
        for r in taken:
            if r not in queued:
                if r.first_token is None:
                    sim.on_prefilled(r, now)
                r.emitted = r.output
                sim.on_finished(r, now)
        sim.coord.set_state(w, S.FAILED)
        sim.coord.holder_failed(w, now)
        if sim.scenario.recovery.restart:
            w.restart()
            sim.coord.set_state(w, S.RESTARTING)
            sim.reloads.start(w, now)
    sim.coord.begin_recovery(now)  # with the victims down: the boost counts them
    for r in sorted(again, key=lambda r: r.rid):
        if not sim.coord.route(r, now):
            sim.wait_for_worker(r, now)
