"""The draft-assist coordinator: pairs recovering workers with overloaded survivors (Algorithm 3).

A restarting worker that has loaded its draft model reports DRAFT_READY; the coordinator pairs it
with the most loaded HEALTHY survivor (`gateway.core.pairing`) and tells both over the control plane
(`StartDraftAssist`: the target connects to the drafter's ZMQ endpoint and starts sending contexts).
A pair ends when the drafter's full model is loaded (it leaves DRAFT_READY and serves on its own),
when the target is no longer overloaded, or when either side fails (`StopDraftAssist`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import structlog

from gateway.core.health import WorkerState
from gateway.core.loadshape import LoadShape
from gateway.core.pairing import PairingParams, pair_drafters, with_load_shape
from gateway.core.types import ClusterView
from gateway.protocol import control_pb2 as pb
from gateway.protocol.planes import CurveKeypair
from gateway.server.metrics import GatewayMetrics
from gateway.server.workers.control import ControlService
from gateway.server.workers.monitor import LoadMonitor

log = structlog.get_logger("lumen.assist")


class DrafterRef(NamedTuple):
    """The drafter paired with a target, as a draft-plane client reaches it: CURVE with `client_keys`
    (the gateway's own) to the drafter's `server_key`."""

    drafter_id: str
    endpoint: str
    server_key: str
    client_keys: CurveKeypair


@dataclass(frozen=True, slots=True)
class PairEvent:
    t: float
    drafter: str
    target: str
    started: bool  # False: the pair ended
    reason: str


class DraftCoordinator:
    def __init__(
        self,
        *,
        monitor: LoadMonitor,
        control: ControlService,
        params: PairingParams,
        k_initial: int,
        view: Callable[[], ClusterView],
        metrics: GatewayMetrics,
    ) -> None:
        self.monitor = monitor
        self.control = control
        self.params = params
        self.k_initial = k_initial
        self._view = view
        self.metrics = metrics
        self.pairs: dict[str, str] = {}
        self.events: deque[PairEvent] = deque(maxlen=1000)
        # the load's shape as completed requests show it (the gateway's sessions feed it)
        self.shape = LoadShape()

    def reconcile(self) -> None:
        """Apply Algorithm 3 to the current view; send Start/Stop for every pair that changed."""
        drafters = [w.id for w in self.monitor.workers.values() if w.state is WorkerState.DRAFT_READY]
        if drafters or self.pairs:
            self.params = with_load_shape(self.params, self.shape)
        new = pair_drafters(self._view(), drafters, self.pairs, self.params) if drafters or self.pairs else {}
        for d, t in self.pairs.items():
            if new.get(d) != t:
                self._stop(d, t)
        for d, t in new.items():
            if self.pairs.get(d) != t:
                self._start(d, t)
        self.pairs = new
        self.metrics.assist_pairs.set(len(new))

    def drafter_of(self, target: str) -> DrafterRef | None:
        """The drafter paired with `target` (id, draft endpoint, its plane key, and the gateway's own
        keys to reach it with), or None."""
        for d, t in self.pairs.items():
            rec = self.monitor.workers.get(d)
            if t == target and rec is not None and rec.state is WorkerState.DRAFT_READY:
                return DrafterRef(d, rec.draft_endpoint, rec.plane_key, self.control.plane_keys)
        return None

    async def run(self, period_s: float) -> None:
        while True:
            self.reconcile()
            await asyncio.sleep(period_s)

    def _start(self, drafter: str, target: str) -> None:
        d = self.monitor.workers[drafter]
        self.control.send(
            target,
            pb.GatewayMessage(
                start_draft_assist=pb.StartDraftAssist(
                    peer_id=drafter,
                    peer_endpoint=d.draft_endpoint,
                    role="target",
                    k=self.k_initial,
                    peer_plane_key=d.plane_key,
                )
            ),
        )
        self.control.send(
            drafter,
            pb.GatewayMessage(
                start_draft_assist=pb.StartDraftAssist(peer_id=target, role="drafter", k=self.k_initial)
            ),
        )
        self._event(drafter, target, True, "paired")

    def _stop(self, drafter: str, target: str) -> None:
        for a, b in ((target, drafter), (drafter, target)):
            w = self.monitor.workers.get(a)
            if w is not None and w.state not in (WorkerState.FAILED, WorkerState.REMOVED):
                self.control.send(a, pb.GatewayMessage(stop_draft_assist=pb.StopDraftAssist(peer_id=b)))
        d = self.monitor.workers.get(drafter)
        reason = (
            "drafter left DRAFT_READY" if d is None or d.state is not WorkerState.DRAFT_READY else "re-paired"
        )
        self._event(drafter, target, False, reason)

    def _event(self, drafter: str, target: str, started: bool, reason: str) -> None:
        self.events.append(PairEvent(self.monitor.clock(), drafter, target, started, reason))
        self.metrics.assist_changes.labels(change="start" if started else "stop").inc()
        log.info("draft_assist", drafter=drafter, target=target, started=started, reason=reason)
