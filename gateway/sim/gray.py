"""Gray failures in the simulator, as the live gateway handles them (`LoadMonitor.check_gray`, core/gray.py).

At every sample tick each worker's measured time per token is compared with its peers'; a worker far
slower is DEGRADED and, with `migrate` (and a mode that fails over), its requests resume elsewhere
through recovery dispatch; a degraded worker back near its peers, or unmeasured for `probation_s`, is
HEALTHY again. The simulation hands each moved request to `resume`.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.core.gray import GrayParams, Observation, gray_verdicts, verdict_inputs
from gateway.core.health import WorkerState
from gateway.sim.coordinator import Coordinator
from gateway.sim.request import SimRequest
from gateway.sim.scenario import GraySpec
from gateway.sim.worker import SimWorker


class SimGray:
    def __init__(self, spec: GraySpec, coord: Coordinator, failover: bool) -> None:
        self.spec = spec
        self.coord = coord
        self.params = GrayParams(spec.enabled, spec.slow_factor, spec.recover_factor, spec.min_peers)
        self.migrate = spec.migrate and failover
        self.degradations = 0  # workers marked DEGRADED

    def check(
        self, workers: list[SimWorker], now: float, resume: Callable[[SimRequest, SimWorker, float], None]
    ) -> None:
        g, coord = self.spec, self.coord
        observations = []
        for w in workers:
            w.measure(now)
            observations.append(Observation(w.id, w.state, w.per_token_s, w.per_token_at, w.degraded_at))
        times, degraded = verdict_inputs(now, observations, g.window_s, g.probation_s)
        verdict = gray_verdicts(times, degraded, self.params)
        for wid in sorted(verdict.degrade):
            w = coord.by_id[wid]
            coord.set_state(w, WorkerState.DEGRADED)
            w.degraded_at = now
            self.degradations += 1
            if not self.migrate:
                continue
            running = [*w.batch.members.values(), *w.prefill_q, *w.restoring]
            for r in running:
                r.durable = coord.durable_at(r, now)
            for r in sorted(w.evict(now), key=lambda r: r.rid):
                resume(r, w, now)
        for wid in sorted(verdict.restore):
            w = coord.by_id[wid]
            coord.set_state(w, WorkerState.HEALTHY)
            w.degraded_at = w.per_token_at = None
