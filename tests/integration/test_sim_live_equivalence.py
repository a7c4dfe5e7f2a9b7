"""One recorded event trace, two shells, the same decisions.

The simulator runs a small scenario with failures and draft assist while `TraceRecorder` records what
the gateway side observed and decided. The trace is then fed, on a fake clock, to the live gateway's
own objects: `LoadMonitor` (Hellos, heartbeats, detach), `CheckpointManager` (assign, durable
reports, release, holder failure), `SessionManager._pick` (the router and recovery dispatch exactly
as a live request resumes) and `DraftCoordinator.reconcile` (pairing). Every decision must match:
routing, holder choice, holder reassignment, restore/replay and where, and draft-assist pairs.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from gateway.config import RecoverySection
from gateway.core.health import WorkerState
from gateway.core.modes import policy_for
from gateway.protocol import control_pb2 as pb
from gateway.server.api.errors import NoWorkerAvailable
from gateway.server.api.jobs import GenerateJob, Sampling
from gateway.server.checkpoints import CheckpointManager
from gateway.server.metrics import GatewayMetrics
from gateway.server.recovery.pairing import DraftCoordinator
from gateway.server.recovery.rehoming import Rehoming
from gateway.server.session_records import Interruption, Session
from gateway.server.sessions import SessionManager
from gateway.server.workers.control import ControlService
from gateway.server.workers.monitor import LoadMonitor
from gateway.sim import trace as tr
from gateway.sim.result import RunResult
from gateway.sim.scenario import parse_scenario
from gateway.sim.simulation import Simulation
from gateway.sim.workload import synthetic

SCENARIO: dict[str, Any] = {
    "cluster": {
        "workers": 4,
        "model": "Qwen3-32B",
        "gpu": "H100-80G",
        "draft_model": "Qwen3-1.7B",
        "draft_load_s": 2.0,
        "model_load_s": 16.0,
    },
    "workload": {"source": "synthetic", "rate": 30.0, "duration_s": 40.0},
    # a server dies (its requests resume, its checkpoints are re-homed); later two more at once
    "failures": [{"at_s": 10.0, "workers": ["w0"]}, {"at_s": 24.0, "workers": ["w1", "w3"]}],
    # the outage batch boost off: the live side of it (OutageAdmission, fed by the control plane's
    # heartbeat hooks) is not part of this replay; tests/integration/test_outage_admission.py and
    # tests/e2e/test_outage_boost.py cover it
    "recovery": {"tau": 256, "theta": 1.0, "outage_batch_boost": 1.0},
    # drafts accepted often enough, and a full reload (16 s) long enough, that loading the draft first
    # pays here (at the default 0.7, or an 8 s reload, the cost gate rightly loads the full model
    # directly on this conv load: docs/design.md 4.5)
    "draft": {"agreement": 0.8},
}

PHASE = {
    WorkerState.RESTARTING: pb.LOADING_DRAFT,
    WorkerState.DRAFT_READY: pb.DRAFT_READY,
    WorkerState.HEALTHY: pb.SERVING,
}


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def record(mode: str, seed: int = 3) -> tuple[Simulation, tr.TraceRecorder, RunResult]:
    scenario = parse_scenario(SCENARIO)
    w = scenario.workload
    workload = synthetic(np.random.default_rng(seed), w.rate, w.duration_s)
    sim = Simulation(scenario, policy_for(mode), workload, seed)
    rec = tr.TraceRecorder()
    rec.attach(sim)
    result = sim.run()
    return sim, rec, result


class LiveShell:
    """The live gateway's coordinator objects, driven by a trace instead of sockets."""

    def __init__(self, sim: Simulation) -> None:
        c = sim.coord
        self.clock = Clock()
        self.monitor = LoadMonitor(clock=self.clock, heartbeat_interval_s=0.02, heartbeat_misses=3)
        self.control = ControlService(self.monitor, token="", heartbeat_interval_ms=20)
        self.ckpt = CheckpointManager(
            monitor=self.monitor,
            control=self.control,
            params=c.holder_params,
            kv_bytes_per_token=c.kvb,
            metrics=GatewayMetrics(),
        )
        self.control.heartbeat_hooks.append(self.ckpt.on_heartbeat)
        Rehoming(monitor=self.monitor, checkpoints=self.ckpt, control=self.control, metrics=GatewayMetrics())
        self.assist = DraftCoordinator(
            monitor=self.monitor,
            control=self.control,
            params=c.pairing_params,
            k_initial=2,
            view=self.ckpt.view,
            metrics=GatewayMetrics(),
        )
        self.sessions = SessionManager(
            monitor=self.monitor,
            http=None,  # type: ignore[arg-type]  # _pick never touches HTTP
            recovery=RecoverySection(mode=c.policy.name, no_worker_wait_s=0.0),
            load_params=c.load,
            metrics=GatewayMetrics(),
            policy=c.policy,
            checkpoints=self.ckpt if c.policy.checkpointing else None,
            dispatch_params=c.dispatch_params,
            cost=c.cost,
            clock=self.clock,
            route_params=c.route_load,
        )
        self.hello: dict[str, pb.Hello] = {}
        self.killed: set[str] = set()
        self.phase: dict[str, int] = {}
        self.live: dict[int, Session] = {}
        self.decisions: list[tuple[Any, ...]] = []

    # -- observations -------------------------------------------------------------------------------
    def on_attach(self, e: tr.Attach) -> None:
        self.hello[e.worker] = pb.Hello(
            protocol_version=1,
            worker_id=e.worker,
            incarnation=1,
            http_url=f"http://{e.worker}",
            kv_endpoint=f"tcp://{e.worker}",
            kv_capacity_tokens=e.kv_capacity_tokens,
            ckpt_budget_bytes=e.ckpt_budget_bytes,
            failure_domain=e.failure_domain,
            phase=pb.SERVING,
        )
        self._attach(e.worker)

    def _attach(self, wid: str) -> None:
        self.monitor.attach(self.hello[wid])
        self.control.outboxes[wid] = asyncio.Queue()
        self.phase[wid] = self.hello[wid].phase

    def on_load(self, e: tr.Load) -> None:
        rec = self.monitor.workers[e.worker]
        if e.worker not in self.killed and rec.state is not WorkerState.FAILED:
            hb = pb.Heartbeat(
                running=e.running,
                waiting=e.waiting,
                kv_tokens_used=e.kv_tokens_used,
                phase=self.phase[e.worker],  # type: ignore[arg-type]
            )
            self.control.monitor.heartbeat(rec, hb)
            for hook in self.control.heartbeat_hooks:
                hook(rec, hb)
        # the gateway's own count of what it sent there and the worker has not reported yet
        rec.inflight = e.running + e.waiting + e.pending

    def on_kill(self, e: tr.Kill) -> None:
        self.killed.add(e.worker)  # no heartbeats from now on; detection comes as a State event

    def on_state(self, e: tr.State) -> None:
        if e.state is WorkerState.RESTARTING:
            self.killed.discard(e.worker)
            phase = pb.LOADING_DRAFT if self.sessions.policy.draft_assist else pb.LOADING_FULL
            self.hello[e.worker] = pb.Hello(
                **{
                    f.name: v
                    for f, v in self.hello[e.worker].ListFields()
                    if f.name not in ("incarnation", "phase")
                },
                incarnation=e.incarnation + 1,
                phase=phase,
            )
            self._attach(e.worker)
        else:
            rec = self.monitor.workers[e.worker]
            self.phase[e.worker] = PHASE[e.state]
            self.monitor.heartbeat(rec, pb.Heartbeat(phase=self.phase[e.worker]))  # type: ignore[arg-type]
            assert rec.state is e.state, (e, rec.state)

    def on_durable(self, e: tr.Durable) -> None:
        rec = self.monitor.workers[e.holder]
        hb = pb.Heartbeat(durable=[pb.DurableTokens(rid=f"{e.rid}-{e.attempt}", tokens=e.tokens)])
        self.ckpt.on_heartbeat(rec, hb)

    def on_release(self, e: tr.Release) -> None:
        self.live.pop(e.rid, None)
        self.ckpt.release_session(str(e.rid))

    # -- decisions ------------------------------------------------------------------------------------
    async def on_route(self, e: tr.Route) -> None:
        s = self.live.get(e.rid)
        if s is None:
            job = GenerateJob(str(e.rid), (0,) * e.context, Sampling(max_new_tokens=e.remaining))
            s = self.live[e.rid] = Session(job=job, seed_base=0, arrived=e.t)
        self.decisions.append(("route", e.rid, await self._pick(s)))

    async def on_recover(self, e: tr.Recover) -> None:
        s = self.live[e.rid]
        s.emitted = [0] * (e.context - len(s.job.prompt_ids))
        assert s.remaining == e.remaining
        rec = self.monitor.workers[e.failed]
        s.interruptions.append(Interruption(e.failed, rec.incarnation, "killed", e.t, len(s.emitted), e.t))
        worker = await self._pick(s)
        action = s.interruptions[-1].action if self.sessions.checkpoints is not None else "replay"
        self.decisions.append(("recover", e.rid, action if worker else "replay", worker))
        s.interruptions[-1].resumed_at = e.t

    def on_attempt(self, e: tr.Attempt) -> None:
        if self.sessions.checkpoints is None:
            self.decisions.append(("attempt", e.rid, e.attempt, ()))
            return
        refs = self.ckpt.assign(
            str(e.rid), f"{e.rid}-{e.attempt}", self.monitor.workers[e.serving], e.context, e.remaining
        )
        self.decisions.append(("attempt", e.rid, e.attempt, tuple(r.worker_id for r in refs)))

    def reassignments(self) -> list[tuple[Any, ...]]:
        out = []
        for box in self.control.outboxes.values():
            while not box.empty():
                msg = box.get_nowait()
                if msg.HasField("assign_holder"):
                    rid, attempt = msg.assign_holder.rid.rsplit("-", 1)
                    holders = tuple(h.worker_id for h in msg.assign_holder.holders)
                    out.append(("reassign", int(rid), int(attempt), holders))
        return sorted(out)

    def on_pairs(self, e: tr.Pairs) -> None:
        self.assist.reconcile()
        self.decisions.append(("pairs", tuple(sorted(self.assist.pairs.items()))))

    async def _pick(self, s: Session) -> str | None:
        try:
            return (await self.sessions._pick(s, set())).id
        except NoWorkerAvailable:
            return None


def sim_decisions(events: list[tr.Event]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for e in events:
        if isinstance(e, tr.Route):
            out.append(("route", e.rid, e.worker))
        elif isinstance(e, tr.Recover):
            out.append(("recover", e.rid, e.action, e.worker))
        elif isinstance(e, tr.Attempt):
            out.append(("attempt", e.rid, e.attempt, e.holders))
        elif isinstance(e, tr.Pairs):
            out.append(("pairs", e.pairs))
    return out


async def replay(sim: Simulation, events: list[tr.Event]) -> tuple[list[Any], list[Any], list[Any]]:
    """Feed the trace; returns (live decisions, live reassignments, the sim's reassignments)."""
    shell = LiveShell(sim)
    live_re: list[Any] = []
    sim_re: list[Any] = []
    dead: list[str] = []
    for e in events:
        shell.clock.t = e.t
        if isinstance(e, tr.State) and e.state is WorkerState.FAILED:
            # workers detected in one pass go FAILED together, then their checkpoints are re-homed
            shell.monitor.detach(shell.monitor.workers[e.worker], "killed")
            dead.append(e.worker)
            continue
        if dead and not isinstance(e, tr.Load):
            await asyncio.sleep(0)  # the checkpoint manager handles the pass's failures
            live_re.extend(shell.reassignments())
            dead = []
        if isinstance(e, tr.Reassign):
            sim_re.append(("reassign", e.rid, e.attempt, e.holders))
            continue
        result = getattr(shell, f"on_{type(e).__name__.lower()}")(e)
        if asyncio.iscoroutine(result):
            await result
    return shell.decisions, sorted(live_re), sorted(sim_re)


@pytest.mark.parametrize("mode", ["lumen", "lumen-cost", "fixed_checkpoint", "stop_restart"])
async def test_live_coordinator_takes_the_simulators_decisions(mode: str) -> None:
    sim, rec, _ = record(mode)
    events = rec.events
    expected = sim_decisions(events)
    kinds = {d[0] for d in expected}
    assert {"route", "recover", "attempt"} <= kinds, kinds
    live, live_re, sim_re = await replay(sim, events)
    for i, (a, b) in enumerate(zip(live, expected, strict=True)):
        assert a == b, f"decision {i}: live {a} != sim {b}"
    assert live_re == sim_re
    if sim.policy.checkpointing:
        assert sim_re, "the scenario must exercise holder reassignment"
        actions = {d[2] for d in expected if d[0] == "recover"}
        assert "restore" in actions, actions
    if sim.policy.draft_assist:
        assert any(d[0] == "pairs" and d[1] for d in expected), "the scenario must pair a drafter"


def test_recording_does_not_change_the_run() -> None:
    scenario = parse_scenario(SCENARIO)
    w = scenario.workload
    workload = synthetic(np.random.default_rng(3), w.rate, w.duration_s)
    plain = Simulation(scenario, policy_for("lumen"), workload, 3).run()
    _, _, recorded = record("lumen")
    assert recorded.records == plain.records
    assert recorded.stats == plain.stats
