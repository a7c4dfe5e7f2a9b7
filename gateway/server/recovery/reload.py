"""The reload coordinator: which survivor a restarting worker loads its weights from (issue 14).

A restarting Lumen worker started with `engine.reload = "peer"` asks the same way in its Hello
(worker_hooks/engine/seeding.py) and loads from storage when no answer names a seed.

An SGLang agent whose server died re-attaches in LOADING_FULL with `awaiting_seed` in its Hello (or in
its heartbeats, when the session re-attached before the agent saw the exit) and waits a moment (its
`--seed-wait-s`) before relaunching the server. The coordinator answers once per incarnation with
`ReloadFrom{seed_worker_id, seed_url}`: the seed is chosen by the core's pure rule
(`gateway.core.reload.choose_seed`): a HEALTHY SGLang worker of the same model and TP (`Hello.model`,
`Hello.tp`), not already seeding another restart, the least loaded by the recovery-load estimate. With
no such worker nothing is sent and the agent loads from storage (`disk`).

A seed counts as busy from the ReloadFrom until its restart reports its reload, leaves its loading
state, or the seed itself fails: SGLang's seed sends to one destination at a time.

The agent reports how the reload went with its first SERVING heartbeat (`reload_seconds`,
`reload_source`, `reload_seed`): the monitor puts it in the state timeline (`/admin/events`), and the
coordinator in `lumen_reload_seconds{source}`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import structlog

from gateway.core.health import WorkerState
from gateway.core.reload import choose_seed
from gateway.core.types import LoadParams
from gateway.protocol import control_pb2 as pb
from gateway.protocol.generate import EngineKind
from gateway.server.metrics import GatewayMetrics
from gateway.server.workers.control import ControlService
from gateway.server.workers.monitor import LoadMonitor, StateEvent, WorkerRecord

log = structlog.get_logger("lumen.reload")

# the engines that reload from a seed: SGLang (`--load-format remote_instance`, its agent) and
# Lumen's workers (worker_hooks/engine/seeding.py)
_SEEDED = frozenset({EngineKind.SGLANG, EngineKind.LUMEN})
# the states a restart waits for its weights in; leaving them ends its claim on the seed
_LOADING = frozenset({WorkerState.JOINING, WorkerState.RESTARTING})


@dataclass(frozen=True, slots=True)
class SeedChoice:
    t: float
    worker: str  # the restarting worker
    incarnation: int
    seed: str | None  # None: no seed qualified (it loads from storage)
    seed_url: str


def deployment_key(rec: WorkerRecord) -> str | None:
    """What a seed must share with the restart: the engine (SGLang servers seed SGLang servers,
    Lumen's workers Lumen's), the model and the TP; None: cannot be matched."""
    if rec.engine not in _SEEDED or not rec.model or rec.tp < 1:
        return None
    return f"{rec.engine.value}\x00{rec.model}\x00tp{rec.tp}"


class ReloadCoordinator:
    def __init__(
        self,
        *,
        monitor: LoadMonitor,
        control: ControlService,
        load_params: LoadParams,
        metrics: GatewayMetrics,
    ) -> None:
        self.monitor = monitor
        self.control = control
        self.load_params = load_params
        self.metrics = metrics
        self.seeding: dict[str, str] = {}  # restarting worker -> the seed it was sent to
        self.answered: dict[str, int] = {}  # worker -> the incarnation last answered
        self.choices: deque[SeedChoice] = deque(maxlen=1000)
        control.attach_hooks.append(self.on_attach)
        control.heartbeat_hooks.append(self.on_heartbeat)
        monitor.on_state_change.append(self.on_state_change)

    def choose(self, worker_id: str) -> str | None:
        """The seed for `worker_id` now (core rule over the monitor's view), or None."""
        deployment = {
            w.id: key for w in self.monitor.workers.values() if (key := deployment_key(w)) is not None
        }
        return choose_seed(
            self.monitor.view(),
            worker_id,
            self.load_params,
            busy=frozenset(self.seeding.values()),
            deployment=deployment,
        )

    def on_attach(self, rec: WorkerRecord, hello: pb.Hello) -> None:
        if hello.awaiting_seed:
            self.answer(rec)

    def answer(self, rec: WorkerRecord) -> None:
        """Send a restarting worker its seed (once per incarnation), or nothing if none fits."""
        if rec.engine not in _SEEDED or self.answered.get(rec.id) == rec.incarnation:
            return
        self.answered[rec.id] = rec.incarnation
        self.seeding.pop(rec.id, None)  # an earlier incarnation's claim, if any
        seed = self.choose(rec.id)
        url = self.monitor.workers[seed].http_url if seed is not None else ""
        if seed is not None and not self.control.send(
            rec.id, pb.GatewayMessage(reload_from=pb.ReloadFrom(seed_worker_id=seed, seed_url=url))
        ):
            seed, url = None, ""  # detached meanwhile
        if seed is not None:
            self.seeding[rec.id] = seed
        self.choices.append(SeedChoice(self.monitor.clock(), rec.id, rec.incarnation, seed, url))
        self.metrics.reload_seeds.labels(outcome="seed" if seed is not None else "none").inc()
        log.info("reload_seed", worker=rec.id, incarnation=rec.incarnation, seed=seed, seed_url=url or None)

    def on_heartbeat(self, rec: WorkerRecord, hb: pb.Heartbeat) -> None:
        if hb.awaiting_seed:
            self.answer(rec)
        if not hb.reload_source:
            return
        self.seeding.pop(rec.id, None)
        self.metrics.reload_seconds.labels(source=hb.reload_source).observe(max(0.0, hb.reload_seconds))
        log.info(
            "reloaded",
            worker=rec.id,
            incarnation=rec.incarnation,
            seconds=round(hb.reload_seconds, 3),
            source=hb.reload_source,
            seed=hb.reload_seed or None,
        )

    def on_state_change(self, ev: StateEvent) -> None:
        if ev.worker_id in self.seeding and ev.dst not in _LOADING:
            del self.seeding[ev.worker_id]  # it serves (or failed again): its seed is free
        if ev.dst in (WorkerState.FAILED, WorkerState.REMOVED):
            for restart in [w for w, s in self.seeding.items() if s == ev.worker_id]:
                del self.seeding[restart]  # the seed died: the restart falls back to storage itself
