"""The recovery coordinator: everything the gateway does when a worker fails, and when it comes back,
written once, in order (issue 28).

It is the only subscriber to the worker registry's state changes (`LoadMonitor.on_state_change`,
workers/monitor.py; tests/unit/test_import_boundaries.py holds every other module under
gateway/server to that), and the only listener of the control plane's attaches and heartbeats, the
SGLang poller's polls, the recovery dispatcher's resumes and the outage levers' boost. The components
keep their logic as plain methods, called from here; none of them subscribes to anything or knows
this object. It decides nothing itself: the decisions are the core's (gateway/core), as in the
simulator, whose coordinator (gateway/sim/coordinator.py) names the same steps: `holder_failed`,
`recover`, `begin_recovery`, `repair`.

A worker incarnation fails (`worker_failed`). The registry (`LoadMonitor._fail`) has already written
its fence where it outlives this process (`gateway.state_dir`, workers/fences.py), recorded the kind of
loss (gateway/core/losses.py) and marked it FAILED; then, in this order:

1. metrics: the failure counted by reason, the time its detection took;
2. fence, on the data planes: it stops being a member of every worker's KV and draft planes
   (`ControlService.broadcast_members`);
3. restart and reload: its claim on a seed ends, and restarts it was seeding load from storage
   (recovery/reload.py; a restart's own seed is chosen when it attaches: `on_attach`);
4. `holder_failed`: the checkpoints it held get new holders and their pages are accounted anew
   (recovery/rehoming.py, after the detector's pass: no checkpoint goes to another dying worker);
5. interrupted requests waiting for a slot of its held SGLang batch resume elsewhere
   (workers/held.py);
6. the outage levers re-judge the recovery (recovery/levers.py);
7. a local cluster supervised in this process starts its hung-worker grace (gateway/cluster).

Then, as this returns, the registry zeroes its reported load, ends its control stream (a fenced
worker resets and attaches again as a new incarnation) and interrupts every stream on it. Each
interrupted session `recover`s in its own task (sessions.py → recovery/dispatch.py: the router, then
Algorithm 2, θ/τ: restore on a holder or replay on the least-loaded survivor); the first resume calls
`begin_recovery` here (the outage levers' recovery starts). Draft-assist pairing (`repair`, Algorithm
3, recovery/pairing.py) runs on its own period, and a restart loading its draft model first is told
whether drafting pays (`draft_first`).

Recovery back to HEALTHY, a worker leaving, heartbeats and SGLang polls come here too
(`worker_changed`, `worker_removed`, `on_heartbeat`, `on_poll`).

The order is the one the gateway had when each component subscribed itself in its constructor (the
order the app happened to build them); the steps above are independent bookkeeping but for one
dependency, kept: held batches fail (5) before the levers count the backlog (6).
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.core.health import WorkerState
from gateway.core.outage import admission_limit
from gateway.core.pairing import draft_first_pays, with_batch_limit, with_load_shape
from gateway.protocol import control_pb2 as pb
from gateway.server.checkpoints import CheckpointManager
from gateway.server.metrics import GatewayMetrics
from gateway.server.recovery.levers import OutageLevers
from gateway.server.recovery.pairing import DraftCoordinator
from gateway.server.recovery.rehoming import Rehoming
from gateway.server.recovery.reload import ReloadCoordinator
from gateway.server.workers.control import ControlService
from gateway.server.workers.monitor import LoadMonitor, StateEvent, WorkerRecord
from gateway.server.workers.server_info import ServerInfoReader
from gateway.server.workers.sglang import SGLangPoller


class RecoveryCoordinator:
    def __init__(
        self,
        *,
        monitor: LoadMonitor,
        control: ControlService | None = None,
        metrics: GatewayMetrics | None = None,
        reload: ReloadCoordinator | None = None,
        checkpoints: CheckpointManager | None = None,
        rehoming: Rehoming | None = None,
        levers: OutageLevers | None = None,
        assist: DraftCoordinator | None = None,
        base_batch: int = 0,
    ) -> None:
        """Every part is optional (a mode without checkpoints has no re-homing, a test builds what it
        drives). `base_batch`: a worker's batch limit outside a recovery (the draft-assist gate
        judges the boosted one)."""
        self.monitor = monitor
        self.control = control
        self.metrics = metrics
        self.reload = reload
        self.checkpoints = checkpoints
        self.rehoming = rehoming
        self.levers = levers
        self.assist = assist
        self.base_batch = base_batch
        # set once the gateway serves (it reads with the gateway's HTTP session)
        self.server_info: ServerInfoReader | None = None
        # a local cluster supervised in this process (gateway/cluster/supervisor.py `follow`)
        self.supervisor: Callable[[StateEvent], None] | None = None
        monitor.on_state_change.append(self.on_state_change)
        if control is not None:
            control.attach_hooks.append(self.on_attach)
            control.heartbeat_hooks.append(self.on_heartbeat)
        if levers is not None:
            levers.boost_hooks.append(self.boosted)

    # -- the registry's state changes ------------------------------------------------------------
    def on_state_change(self, ev: StateEvent) -> None:
        if ev.dst is WorkerState.FAILED:
            self.worker_failed(ev)
        elif ev.dst is WorkerState.REMOVED:
            self.worker_removed(ev)
        else:
            self.worker_changed(ev)

    def worker_failed(self, ev: StateEvent) -> None:
        """A worker incarnation failed (the module's doc, steps 1-7)."""
        self._count_failure(ev)  # 1. metrics
        self._members_changed(ev)  # 2. fence on the data planes
        if self.reload is not None:  # 3. restart and reload: seed claims
            self.reload.seed_claims(ev)
        if self.rehoming is not None:  # 4. holder_failed (after the detector's pass)
            self.rehoming.worker_failed(ev.worker_id)
        if self.levers is not None:
            self.levers.held.worker_ended(ev)  # 5. its held batch's waiters resume elsewhere
            self.levers.tick()  # 6. the outage levers
        if self.supervisor is not None:  # 7. the local supervisor's hung-worker grace
            self.supervisor(ev)

    def worker_removed(self, ev: StateEvent) -> None:
        """A worker left (its operator removed it; it was failed first if it was alive)."""
        self._members_changed(ev)
        if self.reload is not None:
            self.reload.seed_claims(ev)
        if self.levers is not None:
            self.levers.held.worker_ended(ev)
            self.levers.tick()

    def worker_changed(self, ev: StateEvent) -> None:
        """Any other change: a worker joining, loading, serving again (HEALTHY), suspect, degraded."""
        if self.reload is not None:  # a restart that serves (or leaves loading) frees its seed
            self.reload.seed_claims(ev)
        if self.levers is not None:
            self.levers.held.worker_ended(ev)  # (only a state that is not alive ends a held batch)
            self.levers.tick()  # a recovery ends once every worker serves and the backlog is gone
        if ev.dst is WorkerState.HEALTHY and self.server_info is not None:
            self.server_info.serving(ev)  # an SGLang server: what it was launched with

    # -- the control plane and the SGLang poller -------------------------------------------------
    def on_attach(self, rec: WorkerRecord, hello: pb.Hello) -> None:
        """A worker incarnation was welcomed: a restart waiting for a seed is told which."""
        if self.reload is not None:
            self.reload.on_attach(rec, hello)

    def on_heartbeat(self, rec: WorkerRecord, hb: pb.Heartbeat) -> None:
        """After the registry took a heartbeat: a seed asked for or a reload reported, the
        checkpoints' durable prefixes, the outage levers renewed."""
        if self.reload is not None:
            self.reload.on_heartbeat(rec, hb)
        if self.checkpoints is not None:
            self.checkpoints.on_heartbeat(rec, hb)
        if self.levers is not None:
            self.levers.tick()

    def follow_polls(self, poller: SGLangPoller) -> None:
        """Listen to the polls of agentless SGLang servers (the app's poller, once it starts)."""
        poller.heartbeat_hooks.append(self.on_poll)

    def on_poll(self, _rec: WorkerRecord) -> None:
        """An agentless SGLang server was polled (its polls are its heartbeats)."""
        if self.levers is not None:
            self.levers.tick()

    # -- recovery --------------------------------------------------------------------------------
    def begin_recovery(self) -> None:
        """An interrupted request is about to resume (`recover`: the dispatcher's resume): the outage
        levers' recovery starts, or goes on."""
        if self.levers is not None:
            self.levers.on_resume()

    def boosted(self, boost: float) -> None:
        """The outage boost just judged: its metric, and the draft-assist gate judges the batch the
        survivors run now (`repair` reads it)."""
        if self.metrics is not None:
            self.metrics.outage_boost.set(boost)
        if self.assist is not None:
            self.assist.params = with_batch_limit(self.assist.params, admission_limit(self.base_batch, boost))

    def draft_first(self, worker_id: str) -> bool:
        """Whether a restart loading its draft model first should go on: drafting for some survivor
        pays for the full model's later start (the simulator's `assist_wanted`); without draft
        assist, never."""
        if self.assist is None:
            return False
        self.assist.params = with_load_shape(self.assist.params, self.assist.shape)
        view = self.checkpoints.view() if self.checkpoints is not None else self.monitor.view()
        return draft_first_pays(view, self.assist.params, exclude=(worker_id,))

    # -- internals -------------------------------------------------------------------------------
    def _count_failure(self, ev: StateEvent) -> None:
        if self.metrics is None:
            return
        self.metrics.worker_failures.labels(reason=ev.reason.split(":")[0][:40]).inc()
        rec = self.monitor.workers.get(ev.worker_id)
        if rec is not None:
            self.metrics.detection_seconds.observe(max(0.0, ev.t - rec.last_heartbeat))

    def _members_changed(self, ev: StateEvent) -> None:
        """A failed (fenced) or removed incarnation stops being a member of the data planes at once."""
        if self.control is not None and ev.src is not ev.dst:
            self.control.broadcast_members()
