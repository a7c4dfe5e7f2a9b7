"""The simulator's shell of the survivors' admission during an outage (gateway/core/outage.py).

The live shell is gateway/server/recovery/outage.py (`OutageAdmission`, leases to Lumen's workers);
both decide with the same core functions. Here the coordinator owns one `SimOutage`: the recovery
starts at the first recovery dispatch and ends once every worker serves and the queues hold no
backlog (`backlog_drained`); meanwhile, in Lumen's modes (`RecoveryPolicy.outage_admission`), every
worker's batch limit is the base times `outage_boost` of the most workers out at once (where the
boost gate says it pays for the load's shape as completed requests show it), and the queues are
ranked shortest prefill first, aged (`queue_rank`). The baselines keep FIFO (resumed first) and their
batch limit.
"""

from __future__ import annotations

from collections import deque

from gateway.core.health import WorkerState
from gateway.core.loadshape import LoadShape
from gateway.core.outage import (
    BoostGate,
    OutageParams,
    admission_limit,
    backlog_drained,
    judge_boost,
    queue_rank,
)
from gateway.sim.request import SimRequest
from gateway.sim.result import BoostJudgement
from gateway.sim.worker import SimWorker, fifo_rank


class SimOutage:
    def __init__(
        self,
        workers: list[SimWorker],
        params: OutageParams,
        shaping: bool,
        gate: BoostGate | None = None,
        shape: LoadShape | None = None,
    ) -> None:
        self.workers = workers
        self.params = params
        self.gate = gate  # the boost's cost model (None: boost on every shape)
        self.shape = shape if shape is not None else LoadShape()  # the load's shape as it completes
        self.shaping = shaping  # the mode has Lumen's outage levers (baselines: only resumed-first)
        self.recovering = False
        self.down_peak = 0  # the most workers out at once during the current recovery
        self.boost = 1.0  # the batch-limit factor in force (`outage_boost`; 1 outside a recovery)
        self.base_running = workers[0].max_running if workers else 0
        self.judgements: list[BoostJudgement] = []  # the boost as judged, for the run's summary

    def rank(self, r: SimRequest) -> tuple[int, float]:
        """Where `r` joins its worker's queue (core `queue_rank`)."""
        prefill = r.prompt + r.emitted - r.restored  # max(1, r.context - r.restored): a call to max
        on = self.recovering and self.shaping
        return queue_rank(r.attempts, prefill if prefill > 1 else 1, self.params, on, r.arrival)

    def set_recovering(self, on: bool, now: float) -> int:
        """Start or end a recovery: re-rank the queues and set the batch limits. Returns the limit."""
        self.recovering = on
        self.down_peak = 0
        if self.params.shortest_first and self.shaping:  # by prefill while recovering, FIFO after
            rank = self.rank if on else fifo_rank
            for w in self.workers:
                w.rank_of = rank
                w.waiting = deque(sorted(w.waiting, key=rank))
        return self._admit(now)

    def check(self, now: float) -> int | None:
        """End the recovery once every worker serves and the queues hold no backlog; while it lasts,
        raise the batch limit if more workers are out than before. The new limit, or None."""
        if not self.recovering:
            return None
        workers = self.workers
        serving = [w for w in workers if w.state is WorkerState.HEALTHY]
        waiting = sum(len(w.waiting) for w in serving)
        if backlog_drained(waiting, len(serving), len(serving) == len(workers)):
            return self.set_recovering(False, now)
        if len(workers) - len(serving) > self.down_peak and self.shaping:
            return self._admit(now)
        return None

    def _admit(self, now: float) -> int:
        """Every worker's batch limit for the recovery as it stands (`outage_boost`), the factor the
        live gateway's OutageAdmission sends to Lumen's workers."""
        on = self.recovering and self.shaping
        if on:
            down = sum(1 for w in self.workers if w.state is not WorkerState.HEALTHY)
            self.down_peak = max(self.down_peak, down)
        shape = self.shape.means() if self.gate is not None else None
        judged = judge_boost(self.params, on, len(self.workers), self.down_peak, self.gate, shape)
        self.boost = judged.granted
        if judged.factor > 1.0:
            self.judgements.append(BoostJudgement(now, judged.factor, judged.gain, judged.granted > 1.0))
        limit = admission_limit(self.base_running, self.boost)
        for w in self.workers:
            if w.max_running != limit:
                w.max_running = limit
                if w.alive:
                    w.kick(now)
        return limit
