"""The outage levers of one gateway, wired once (gateway/core/outage.py; issue 17).

- `OutageAdmission` (outage.py), in Lumen's modes: judges each recovery after every resume, heartbeat
  and state change, and grants Lumen's workers the boosted batch and the queue order as leases;
- `HeldBatches` (workers/held.py): SGLang servers launched with room for the boost, held to their
  batch at the gateway, and to the boosted batch while a recovery lasts;
- `queue_priority`: each SGLang request's place in its server's queue (or in its held gate), the same
  rank Lumen's workers and the simulator use.

`boost_hooks` get the factor after every judgement (the recovery coordinator: its metric and the
draft-assist gate, which judges the batch the survivors run). Nothing here subscribes to the workers:
the recovery coordinator (coordinator.py) calls `tick` after every heartbeat and state change and
`on_resume` at every resume. The app and the sim/live equivalence test build this one object and the
coordinator, so the test replays exactly the wiring the gateway runs.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.core.loadshape import LoadShape
from gateway.core.outage import BOOST_LEASE_S, BoostGate, OutageParams, queue_priority
from gateway.server.recovery.outage import OutageAdmission
from gateway.server.workers.control import ControlService
from gateway.server.workers.held import HeldBatches
from gateway.server.workers.monitor import LoadMonitor


class OutageLevers:
    def __init__(
        self,
        *,
        monitor: LoadMonitor,
        control: ControlService,
        params: OutageParams,
        shaping: bool,
        clock: Callable[[], float],
        heartbeat_interval_s: float,
        gate: BoostGate | None = None,
    ) -> None:
        self.params = params
        self.clock = clock
        self.held = HeldBatches(monitor)
        self.boost_hooks: list[Callable[[float], None]] = []
        self.admission: OutageAdmission | None = None
        if shaping and (params.batch_boost > 1 or params.shortest_first):
            self.admission = OutageAdmission(
                monitor=monitor,
                control=control,
                params=params,
                clock=clock,
                # renewed on heartbeats: a lease must outlast a few of them
                lease_s=max(BOOST_LEASE_S, 3 * heartbeat_interval_s),
                held_waiting=self.held.waiting,
                gate=gate,
            )
            self.admission.boost_hooks.append(self._boosted)

    def set_shape(self, shape: LoadShape) -> None:
        """The load's shape estimate the boost gate judges (the sessions feed it)."""
        if self.admission is not None:
            self.admission.shape = shape

    @property
    def recovering(self) -> bool:
        return self.admission is not None and self.admission.recovering

    def on_resume(self) -> None:
        """An interrupted request is being resumed (the recovery dispatcher's hook)."""
        if self.admission is not None:
            self.admission.on_resume()

    def tick(self) -> None:
        """After a heartbeat or state change: nothing to do outside a recovery but at its end."""
        if self.admission is not None and self.admission.recovering:
            self.admission.tick()

    def queue_priority(self, attempt: int, prefill_tokens: int) -> int:
        """A request's queue rank now, as one integer (lower first)."""
        return queue_priority(attempt, prefill_tokens, self.params, self.recovering, self.clock())

    def _boosted(self, boost: float) -> None:
        self.held.set_boost(boost)
        for hook in self.boost_hooks:
            hook(boost)
