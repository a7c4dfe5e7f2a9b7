"""The gateway's reload coordinator: which survivor a restarting SGLang server is told to load from, and
how its reload report lands in the timeline (no network: the control service's outboxes are read)."""

from __future__ import annotations

import asyncio

from gateway.core.health import WorkerState
from gateway.core.types import LoadParams
from gateway.protocol import control_pb2 as pb
from gateway.protocol.generate import EngineKind
from gateway.server.metrics import GatewayMetrics
from gateway.server.recovery.reload import ReloadCoordinator
from gateway.server.workers.control import ControlService
from gateway.server.workers.monitor import LoadMonitor, WorkerRecord, reload_note


class Cluster:
    def __init__(self) -> None:
        self.now = 0.0
        self.monitor = LoadMonitor(clock=lambda: self.now, heartbeat_interval_s=0.05, heartbeat_misses=3)
        self.control = ControlService(self.monitor, token="", heartbeat_interval_ms=50)
        self.metrics = GatewayMetrics()
        self.coord = ReloadCoordinator(
            monitor=self.monitor,
            control=self.control,
            load_params=LoadParams(alpha=1.0, beta=1.0, nominal_batch=8),
            metrics=self.metrics,
        )
        self.incarnations: dict[str, int] = {}

    def attach(
        self,
        wid: str,
        *,
        model: str = "m",
        tp: int = 1,
        running: int = 0,
        engine: str = EngineKind.SGLANG,
        serving: bool = True,
        awaiting_seed: bool = False,
    ) -> WorkerRecord:
        """What ControlService.Attach does, less the stream: attach, open the outbox, run the hooks."""
        self.incarnations[wid] = self.incarnations.get(wid, 0) + 1
        hello = pb.Hello(
            worker_id=wid,
            incarnation=self.incarnations[wid],
            model=model,
            tp=tp,
            http_url=f"http://10.0.0.{len(self.incarnations)}:30000",
            engine=engine,
            kv_capacity_tokens=10_000,
            phase=pb.SERVING if serving else pb.LOADING_FULL,
            awaiting_seed=awaiting_seed,
        )
        rec = self.monitor.attach(hello)
        self.control.outboxes[wid] = asyncio.Queue()
        for hook in self.control.attach_hooks:
            hook(rec, hello)
        if running:
            self.beat(rec, pb.Heartbeat(phase=pb.SERVING, running=running))
        return rec

    def beat(self, rec: WorkerRecord, hb: pb.Heartbeat) -> None:
        self.monitor.heartbeat(rec, hb)
        for hook in self.control.heartbeat_hooks:
            hook(rec, hb)

    def fail(self, wid: str) -> None:
        self.monitor.detach(self.monitor.workers[wid], "test")

    def sent(self, wid: str) -> list[pb.GatewayMessage]:
        box = self.control.outboxes[wid]
        out = []
        while not box.empty():
            out.append(box.get_nowait())
        return out


def restart(c: Cluster, wid: str, **kw: object) -> WorkerRecord:
    c.fail(wid)
    return c.attach(wid, serving=False, awaiting_seed=True, **kw)  # type: ignore[arg-type]


def test_the_seed_is_the_least_loaded_healthy_survivor_of_the_same_model_and_tp() -> None:
    c = Cluster()
    c.attach("r")
    c.attach("busy", running=6)
    c.attach("idle", running=1)
    c.attach("other-tp", tp=2)
    c.attach("other-model", model="n")
    c.attach("lumen", engine=EngineKind.LUMEN)
    c.attach("loading", serving=False)
    rec = restart(c, "r")
    [msg] = c.sent("r")
    assert msg.incarnation == rec.incarnation
    assert (msg.reload_from.seed_worker_id, msg.reload_from.seed_url) == (
        "idle",
        c.monitor.workers["idle"].http_url,
    )
    assert c.coord.seeding == {"r": "idle"}


def test_a_seed_serves_one_restart_at_a_time_and_is_free_once_it_has_reloaded() -> None:
    c = Cluster()
    for wid, load in (("a", 8), ("b", 8), ("seed1", 1), ("seed2", 3)):
        c.attach(wid, running=load)
    ra = restart(c, "a")
    restart(c, "b")
    assert c.coord.seeding == {"a": "seed1", "b": "seed2"}  # seed1 was busy for b
    c.beat(ra, pb.Heartbeat(phase=pb.SERVING, reload_seconds=2.5, reload_source="peer", reload_seed="seed1"))
    assert c.coord.seeding == {"b": "seed2"}
    assert c.monitor.workers["a"].state is WorkerState.HEALTHY
    assert 'lumen_reload_seconds_count{source="peer"} 1.0' in c.metrics.render().decode()
    c.fail("seed2")  # a seed that dies frees its restart's claim (the agent falls back by itself)
    assert c.coord.seeding == {}


def test_no_seed_no_command() -> None:
    c = Cluster()
    c.attach("r")
    c.attach("s", tp=4)
    restart(c, "r")
    assert c.sent("r") == [] and c.coord.choices[-1].seed is None
    assert 'lumen_reload_seed_choices_total{outcome="none"} 1.0' in c.metrics.render().decode()


def test_a_restart_is_answered_once_from_its_hello_or_its_heartbeats() -> None:
    c = Cluster()
    c.attach("r")
    c.attach("s")
    c.fail("r")
    rec = c.attach("r", serving=False)  # re-attached before the agent saw its server's exit
    assert c.sent("r") == []
    c.beat(rec, pb.Heartbeat(phase=pb.LOADING_FULL, awaiting_seed=True))
    c.beat(rec, pb.Heartbeat(phase=pb.LOADING_FULL, awaiting_seed=True))
    assert [m.reload_from.seed_worker_id for m in c.sent("r")] == ["s"]


def test_a_reload_report_is_in_the_timeline() -> None:
    c = Cluster()
    c.attach("s")
    rec = restart(c, "s")
    c.beat(rec, pb.Heartbeat(phase=pb.SERVING, reload_seconds=41.0, reload_source="disk", reload_seed="x"))
    ev = c.monitor.events[-1]
    assert (ev.src, ev.dst) == (WorkerState.RESTARTING, WorkerState.HEALTHY)
    assert ev.reason == "phase SERVING; reloaded from storage (disk) in 41.00 s, seed x failed"
    # a report on a beat that changes no state is an event of its own
    c.beat(rec, pb.Heartbeat(phase=pb.SERVING, reload_seconds=3.2, reload_source="peer", reload_seed="y"))
    ev = c.monitor.events[-1]
    assert (ev.src, ev.dst, ev.reason) == (
        WorkerState.HEALTHY,
        WorkerState.HEALTHY,
        reload_note(3.2, "peer", "y"),
    )
    assert ev.reason == "reloaded from y (peer) in 3.20 s"
