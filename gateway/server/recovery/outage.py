"""The live shell of the survivors' admission during an outage (gateway/core/outage.py, issue 17).

From the first recovery dispatch (an interrupted request resumed elsewhere) until every worker serves
again and the queues hold no backlog (`backlog_drained`), every serving Lumen worker may admit a
larger batch (`outage_boost` of the most workers out at once during this recovery, the factor the
simulator's coordinator applies, where the boost gate says it pays for the load's shape: judged, as
the simulator judges it, when the recovery begins and whenever more workers are out than before) and
orders its queue shortest prefill first, aged
(`shortest_first`, `shortest_first_rate`). Both go to each worker as a lease (`SetAdmission`) renewed
every third of `BOOST_LEASE_S` while the recovery lasts, and withdrawn (boost 1, FIFO) when it ends;
a gateway that dies leaves no worker changed for longer than a lease. SGLang servers take no lease:
their batch limit is a launch argument (`--max-running-requests`) that SGLang 0.5.23 cannot change at
run time (its /set_internal_state takes pp_max_micro_batch_size and speculative thresholds only); the
gateway holds the batch of those launched with room for the boost (`boost_hooks`, held.py) and orders
their queues by request priorities (server_info.py).

Driven by events, not a timer of its own: `on_resume` from the recovery dispatcher, and `tick` after
every heartbeat and worker state change, so the renewals ride on the heartbeat cadence.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from gateway.core.health import WorkerState
from gateway.core.loadshape import LoadShape
from gateway.core.outage import (
    BOOST_LEASE_S,
    BoostGate,
    OutageParams,
    backlog_drained,
    judge_boost,
    outage_boost,
)
from gateway.protocol import control_pb2 as pb
from gateway.protocol.generate import EngineKind
from gateway.server.workers.control import ControlService
from gateway.server.workers.monitor import LoadMonitor, WorkerRecord

log = structlog.get_logger("lumen.outage")

_LEFT = frozenset({WorkerState.DRAINING, WorkerState.REMOVED})
_NONE = (1.0, False)  # no boost, FIFO: what a worker does outside a recovery


class OutageAdmission:
    """One gateway's judgement of the current recovery and its grants to Lumen's workers (see above);
    `boost` and `recovering` are what it granted last."""

    def __init__(
        self,
        *,
        monitor: LoadMonitor,
        control: ControlService,
        params: OutageParams,
        clock: Callable[[], float],
        lease_s: float = BOOST_LEASE_S,
        held_waiting: Callable[[str], int] = lambda _worker_id: 0,
        gate: BoostGate | None = None,
    ) -> None:
        self.monitor = monitor
        self.control = control
        self.params = params
        self.clock = clock
        self.lease_s = lease_s
        self.recovering = False
        self.down_peak = 0  # the most workers out at once during this recovery
        self.boost = 1.0  # the factor granted now
        self.gate = gate  # the boost's cost model (None: boost on every shape)
        # the load's shape as completed requests show it (the app gives the sessions' estimate), and
        # its means as judged when the recovery began or more workers went out
        self.shape = LoadShape()
        self._judged: tuple[float, float] | None = None
        # worker id -> (incarnation, (boost, shortest first), when) of the last grant sent to it
        self._sent: dict[str, tuple[int, tuple[float, bool], float]] = {}
        self.recoveries = 0
        # called with the factor after every judgement (the app: held SGLang servers, the metric, the
        # draft-assist gate)
        self.boost_hooks: list[Callable[[float], None]] = []
        # requests the gateway itself holds for a worker (gateway/server/workers/held.py): backlog too
        self.held_waiting = held_waiting

    def on_resume(self) -> None:
        """An interrupted request is being resumed: the cluster recovers from a failure."""
        if not self.recovering:
            self.recovering = True
            self.recoveries += 1
            self.down_peak = 0
            self._judged = None
            log.info("recovery started: outage admission on")
        self.tick()

    def tick(self) -> None:
        """Re-judge the recovery (over once no worker is out and no backlog is left) and grant or
        renew the factor for it to every serving Lumen worker."""
        if not self.recovering:
            return
        # a worker drained or removed by its operator is not a failure
        workers = [w for w in self.monitor.workers.values() if w.state not in _LEFT]
        serving = [w for w in workers if w.state is WorkerState.HEALTHY]
        waiting = sum(w.waiting + self.held_waiting(w.id) for w in serving)
        if backlog_drained(waiting, len(serving), len(serving) == len(workers)):
            self.recovering = False
            log.info("recovery over: outage admission off", down_peak=self.down_peak)
        else:
            down = len(workers) - len(serving)
            if down > self.down_peak:  # the gate judges the shape as the simulator does: now
                self.down_peak = down
                self._judged = self.shape.means() if self.gate is not None else None
                self._log_judgement(len(workers))
        self.boost = outage_boost(
            self.params, self.recovering, len(workers), self.down_peak, self.gate, self._judged
        )
        self._grant(serving)
        for hook in self.boost_hooks:
            hook(self.boost)

    def _log_judgement(self, workers: int) -> None:
        """What the boost gate decided for the recovery as it stands, for the operator: the factor
        the cluster's slots call for, the gain the cost model gives it for the load's shape, and
        whether it is granted."""
        j = judge_boost(self.params, True, workers, self.down_peak, self.gate, self._judged)
        if j.gain is None or self._judged is None:
            return
        p, o = self._judged
        log.info(
            "outage boost judged",
            factor=round(j.factor, 3),
            gain=round(j.gain, 4),
            min_gain=self.params.boost_min_gain,
            granted=j.granted > 1.0,
            prompt_tokens=round(p, 1),
            output_tokens=round(o, 1),
            shape_measured=self.shape.ready,
        )

    def _grant(self, serving: list[WorkerRecord]) -> None:
        now = self.clock()
        renew_after = self.lease_s / 3
        sjf = self.recovering and self.params.shortest_first
        grant = (self.boost, sjf)
        for w in serving:
            if w.engine is not EngineKind.LUMEN:
                continue
            last = self._sent.get(w.id)
            current = last is not None and last[0] == w.incarnation
            if grant == _NONE and not (current and last is not None and last[1] != _NONE):
                continue  # nothing granted to this incarnation: nothing to withdraw
            if current and last is not None and last[1] == grant and now - last[2] < renew_after:
                continue
            msg = pb.GatewayMessage(
                set_admission=pb.SetAdmission(
                    batch_boost=self.boost,
                    lease_s=self.lease_s,
                    shortest_first=sjf,
                    shortest_first_rate=self.params.shortest_first_rate,
                )
            )
            if self.control.send(w.id, msg):
                self._sent[w.id] = (w.incarnation, grant, now)
