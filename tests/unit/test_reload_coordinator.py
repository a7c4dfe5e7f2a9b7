"""The gateway's reload coordinator: which survivor a restarting SGLang server is told to load from, and
how its reload report lands in the timeline (no network: the control service's outboxes are read)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from gateway.core.costmodel import ReloadSource
from gateway.core.health import WorkerState
from gateway.core.types import LoadParams
from gateway.protocol import control_pb2 as pb
from gateway.protocol.generate import EngineKind
from gateway.server.metrics import GatewayMetrics
from gateway.server.recovery.coordinator import RecoveryCoordinator
from gateway.server.recovery.reload import ReloadCoordinator, SeedProbe
from gateway.server.workers.control import ControlService
from gateway.server.workers.monitor import LoadMonitor, WorkerRecord, reload_note


class Cluster:
    def __init__(self, reload: str = "peer", **kw: Any) -> None:
        self.now = 0.0
        self.monitor = LoadMonitor(clock=lambda: self.now, heartbeat_interval_s=0.05, heartbeat_misses=3)
        self.control = ControlService(self.monitor, token="", heartbeat_interval_ms=50)
        self.metrics = GatewayMetrics()
        self.coord = ReloadCoordinator(
            monitor=self.monitor,
            control=self.control,
            load_params=LoadParams(alpha=1.0, beta=1.0, nominal_batch=8),
            metrics=self.metrics,
            reload=ReloadSource(reload),
            **kw,
        )
        # as the gateway wires it: the recovery coordinator passes on attaches, heartbeats, state changes
        RecoveryCoordinator(monitor=self.monitor, control=self.control, reload=self.coord)
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


# -- engine.reload is obeyed ------------------------------------------------------------------------
def test_with_engine_reload_disk_no_seed_is_ever_named() -> None:
    """The default: a restart that asks is told nothing and loads from storage (seen on real SGLang: a
    peer reload ran though engine.reload was "disk")."""
    c = Cluster(reload="disk")
    c.attach("r")
    c.attach("idle")
    rec = restart(c, "r")
    c.beat(rec, pb.Heartbeat(phase=pb.LOADING_FULL, awaiting_seed=True))
    assert c.sent("r") == [] and c.coord.seeding == {}
    choice = c.coord.choices[-1]
    assert (choice.worker, choice.seed, choice.off) == ("r", None, True)
    assert 'lumen_reload_seed_choices_total{outcome="off"} 1.0' in c.metrics.render().decode()


def test_the_gateway_passes_its_engine_reload_to_the_coordinator() -> None:
    from gateway.config import load_config
    from gateway.server.app import Gateway

    assert Gateway(load_config(overrides={"gateway.port": 0})).reload.peer is False
    assert Gateway(load_config(overrides={"gateway.port": 0, "engine.reload": "peer"})).reload.peer is True


# -- a seed that stops generating is found by a generation probe, not /ready ---------------------------
class Probe:
    """A seed's answers to the coordinator's one-token probe: `answer` False = no token in time."""

    def __init__(self) -> None:
        self.answer = True
        self.calls: list[tuple[str, float]] = []
        self.during: Any = None  # called during a probe (a stream's token arriving meanwhile)

    async def __call__(self, rec: WorkerRecord, timeout_s: float) -> bool:
        self.calls.append((rec.id, timeout_s))
        await asyncio.sleep(0)
        if self.during is not None:
            self.during()
        return self.answer


def seeded(probe: Probe, **kw: Any) -> tuple[Cluster, WorkerRecord]:
    c = Cluster(probe=probe, probe_params=SeedProbe(interval_s=0.01, timeout_s=0.5), **kw)
    c.attach("r")
    seed = c.attach("s")
    restart(c, "r")
    assert c.coord.seeding == {"r": "s"}
    return c, seed


async def wait(cond: Any, within_s: float = 2.0) -> None:
    async with asyncio.timeout(within_s):
        while not cond():
            await asyncio.sleep(0.005)


async def test_a_seed_that_stops_generating_is_failed_and_its_claim_freed() -> None:
    probe = Probe()
    c, seed = seeded(probe)
    await wait(lambda: len(probe.calls) >= 3)
    assert seed.state is WorkerState.HEALTHY  # answering: left alone
    probe.answer = False  # its scheduler is stuck in the weight-transfer set-up; /ready would still say 200
    await wait(lambda: seed.state is WorkerState.FAILED)
    ev = [e for e in c.monitor.events if e.worker_id == "s"][-1]
    assert ev.dst is WorkerState.FAILED and ev.reason.startswith("seed stopped generating")
    assert "sending weights to r" in ev.reason
    assert c.coord.seeding == {} and [s.seed for s in c.coord.stopped] == ["s"]
    assert 'lumen_reload_seed_choices_total{outcome="seed_stopped"} 1.0' in c.metrics.render().decode()
    await c.coord.close()


async def test_a_seed_whose_streams_get_tokens_is_not_failed_by_a_slow_probe() -> None:
    """A busy seed may queue the probe; tokens on its streams meanwhile show it generates."""
    probe = Probe()
    c, seed = seeded(probe)
    probe.answer = False

    def token() -> None:
        c.now += 0.001
        c.monitor.observe_tokens("s", seed.incarnation, 1, 0.02)

    probe.during = token
    await wait(lambda: len(probe.calls) >= 5)
    assert seed.state is WorkerState.HEALTHY
    await c.coord.close()


async def test_probing_ends_with_the_seeds_claim() -> None:
    probe = Probe()
    c, _seed = seeded(probe)
    await wait(lambda: len(probe.calls) >= 1)
    ra = c.monitor.workers["r"]
    c.beat(ra, pb.Heartbeat(phase=pb.SERVING, reload_seconds=1.0, reload_source="peer", reload_seed="s"))
    assert c.coord.seeding == {}
    await wait(lambda: not c.coord._watches)
    n = len(probe.calls)
    await asyncio.sleep(0.05)
    assert len(probe.calls) == n


@pytest.mark.parametrize("hangs", [False, True])
async def test_the_http_probe_is_a_one_token_generate(hangs: bool) -> None:
    seen: list[Any] = []
    release = asyncio.Event()

    async def generate(request: web.Request) -> web.Response:
        seen.append(await request.json())
        if hangs:
            await release.wait()
        return web.json_response({"output_ids": [5], "meta_info": {}})

    app = web.Application()
    app.router.add_post("/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    async with aiohttp.ClientSession() as http:
        c = Cluster(http=lambda: http)
        rec = c.attach("s")
        rec.http_url = f"http://127.0.0.1:{port}"
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await c.coord._generate_probe(rec, 0.3) is (not hangs)
        assert loop.time() - t0 < (0.6 if hangs else 0.3)
    release.set()
    await runner.cleanup()
    assert seen and seen[0]["sampling_params"] == {"max_new_tokens": 1, "temperature": 0.0}
    assert seen[0]["input_ids"] == [0] and seen[0]["rid"].startswith("lumen-seed-probe-")
