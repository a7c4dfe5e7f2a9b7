"""One recorded event trace, two shells, the same decisions.

The simulator runs a small scenario with failures and draft assist while `TraceRecorder` records what
the gateway side observed and decided. The trace is then fed, on a fake clock, to the live gateway's
own objects: `LoadMonitor` (Hellos, heartbeats, detach), `CheckpointManager` (assign, durable
reports, release, holder failure), `SessionManager._pick` (the router and recovery dispatch exactly
as a live request resumes), `DraftCoordinator.reconcile` (pairing) and `OutageAdmission` (the outage
levers, wired as the gateway wires it; its SetAdmission messages applied to each worker's lease book
as Lumen's worker applies them). Every decision must match: routing, holder choice, holder
reassignment, restore/replay and where, draft-assist pairs, and the outage admission in force (the
recovery, its batch-limit factor, each worker's batch limit and queue order) at every decision.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from gateway.config import RecoverySection
from gateway.core.health import WorkerState
from gateway.core.modes import policy_for
from gateway.core.outage import outage_params
from gateway.protocol import control_pb2 as pb
from gateway.server.api.errors import NoWorkerAvailable
from gateway.server.api.jobs import GenerateJob, Sampling
from gateway.server.checkpoints import CheckpointManager
from gateway.server.metrics import GatewayMetrics
from gateway.server.recovery.coordinator import RecoveryCoordinator
from gateway.server.recovery.levers import OutageLevers
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
from gateway.sim.workload import SHAPES, synthetic
from tests.fixtures.clock import FakeClock
from worker_hooks.engine.admission import AdmissionLeases

SCENARIO: dict[str, Any] = {
    "cluster": {
        "workers": 4,
        "model": "Qwen3-32B",
        "gpu": "H100-80G",
        "draft_model": "Qwen3-1.7B",
        "draft_load_s": 2.0,
        "model_load_s": 20.0,
    },
    "workload": {"source": "synthetic", "rate": 30.0, "duration_s": 40.0},
    # a server dies (its requests resume, its checkpoints are re-homed); later two more at once
    "failures": [{"at_s": 10.0, "workers": ["w0"]}, {"at_s": 24.0, "workers": ["w1", "w3"]}],
    # the outage levers at their defaults (batch boost up to 1.5, aged shortest prefill first)
    "recovery": {"tau": 256, "theta": 1.0},
    # drafts accepted often enough, and a full reload (20 s) long enough, that loading the draft first
    # pays here even on the boosted batch the gate then judges (at 0.8 with a 16 s reload it pays only
    # without the boost; at the default 0.7 it does not: docs/design.md 4.5)
    "draft": {"agreement": 0.95},
}

PHASE = {
    WorkerState.RESTARTING: pb.LOADING_DRAFT,
    WorkerState.DRAFT_READY: pb.DRAFT_READY,
    WorkerState.HEALTHY: pb.SERVING,
}


HEARTBEAT_S = 0.02  # the live shell's heartbeat interval


@dataclass(frozen=True, slots=True)
class InForce:
    """The outage admission in force in one shell at one moment."""

    recovering: bool
    boost: float  # the batch-limit factor
    # each worker the gateway sees HEALTHY: (its batch limit, its shortest-first rate; None: FIFO)
    workers: dict[str, tuple[int, float | None]]


# a code-like load (long prompts, short outputs: prefill-bound), long enough before its failure that
# the load's shape is known (core/loadshape.py: 1,000 completed requests): the boost gate keeps the
# batch limit (core/outage.py `boost_gain`), and both shells must judge it alike
CODE_SCENARIO: dict[str, Any] = {
    **SCENARIO,
    "workload": {"source": "synthetic", "shape": "code", "rate": 30.0, "duration_s": 70.0},
    "failures": [{"at_s": 50.0, "workers": ["w0"]}],
}


def record(
    mode: str, seed: int = 3, spec: dict[str, Any] = SCENARIO
) -> tuple[Simulation, tr.TraceRecorder, RunResult]:
    scenario = parse_scenario(spec)
    w = scenario.workload
    inputs, outputs = SHAPES[w.shape]
    workload = synthetic(np.random.default_rng(seed), w.rate, w.duration_s, 1.0, inputs, outputs)
    sim = Simulation(scenario, policy_for(mode), workload, seed)
    rec = tr.TraceRecorder()
    rec.attach(sim)
    result = sim.run()
    return sim, rec, result


class LiveShell:
    """The live gateway's coordinator objects, driven by a trace instead of sockets."""

    def __init__(self, sim: Simulation) -> None:
        c, lever = sim.coord, sim.scenario.recovery
        self.clock = FakeClock()
        self.monitor = LoadMonitor(clock=self.clock, heartbeat_interval_s=HEARTBEAT_S, heartbeat_misses=3)
        self.control = ControlService(self.monitor, token="", heartbeat_interval_ms=20)
        self.ckpt = CheckpointManager(
            monitor=self.monitor,
            control=self.control,
            params=c.holder_params,
            kv_bytes_per_token=c.kvb,
            metrics=GatewayMetrics(),
        )
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
            recovery=RecoverySection(
                mode=c.policy.name,
                no_worker_wait_s=0.0,
                resumed_first=lever.resumed_first,
                outage_batch_boost=lever.outage_batch_boost,
                outage_shortest_first=lever.outage_shortest_first,
                outage_shortest_first_rate=lever.outage_shortest_first_rate,
                outage_boost_min_gain=lever.outage_boost_min_gain,
            ),
            load_params=c.load,
            metrics=GatewayMetrics(),
            policy=c.policy,
            checkpoints=self.ckpt if c.policy.checkpointing else None,
            dispatch_params=c.dispatch_params,
            cost=c.cost,
            clock=self.clock,
            route_params=c.route_load,
        )
        # the outage levers, the object gateway/server/app.py builds and wires (recovery/levers.py):
        # in Lumen's modes started by the dispatcher's resume hook, ticked after every heartbeat and
        # state change; the pairing gate judges the boosted batch (RecoveryCoordinator.boosted)
        r = self.sessions.recovery
        params = outage_params(r)
        assert params == c.outage.params  # the scenario's levers reach both shells alike
        self.base_running = c.outage.base_running
        self.levers = OutageLevers(
            monitor=self.monitor,
            control=self.control,
            params=params,
            shaping=c.policy.outage_admission,
            clock=self.clock,
            heartbeat_interval_s=HEARTBEAT_S,
            gate=c.outage.gate,  # the app's: a worker as the engine section sizes it
        )
        self.levers.set_shape(self.sessions.load_shape)  # as the app wires it
        self.outage = self.levers.admission
        # the recovery coordinator, as the app builds it (recovery/coordinator.py): the one listener
        # of the monitor's state changes and the control plane's heartbeats (checkpoint books,
        # re-homing, the levers), the levers' boost (the pairing gate) and the dispatcher's resumes
        self.coordinator = RecoveryCoordinator(
            monitor=self.monitor,
            control=self.control,
            metrics=GatewayMetrics(),
            checkpoints=self.ckpt,
            rehoming=Rehoming(checkpoints=self.ckpt, control=self.control, metrics=GatewayMetrics()),
            levers=self.levers,
            assist=self.assist,
            base_batch=self.base_running,
        )
        self.sessions.dispatcher.resume_hooks.append(self.coordinator.begin_recovery)
        # the control seam: each SetAdmission sent (still queued to its worker's outbox) is applied
        # to that worker incarnation's own lease book, as Lumen's worker applies it (agent.py)
        self.leases: dict[tuple[str, int], AdmissionLeases] = {}
        self.grants = 0
        send = self.control.send

        def send_and_apply(wid: str, msg: pb.GatewayMessage) -> bool:
            ok = send(wid, msg)
            if ok and msg.HasField("set_admission"):
                a = msg.set_admission
                book = self.leases.setdefault(
                    (wid, msg.incarnation), AdmissionLeases(self.base_running, self.clock)
                )
                book.grant(
                    "gw", a.batch_boost, a.lease_s, a.shortest_first_rate if a.shortest_first else None
                )
                self.grants += 1
            return ok

        self.control.send = send_and_apply  # type: ignore[method-assign,assignment]
        # the simulator's outage admission as recorded: the last Outage event, each worker's Admission
        self.sim_outage = tr.Outage(0.0, False, 1.0, 0)
        self.sim_admitted: dict[str, tuple[int, bool]] = {}
        self.sim_rate = c.outage.params.shortest_first_rate
        self.shaping = c.policy.outage_admission
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
        if e.completed is not None:  # the sessions feed the load's shape (sessions.py)
            self.sessions.load_shape.observe(*e.completed)
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

    def on_outage(self, e: tr.Outage) -> None:
        self.sim_outage = e

    def on_admission(self, e: tr.Admission) -> None:
        self.sim_admitted[e.worker] = (e.limit, e.shortest_first)

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

    def in_force(self) -> tuple[InForce, InForce]:
        """The outage admission in force now, (live, simulator), over the workers the gateway sees
        HEALTHY. Live: `OutageAdmission`'s judgement and each worker incarnation's lease book.
        Simulator: its last Outage event and each worker's last Admission (before any: the base limit,
        FIFO)."""
        base, rate = self.base_running, self.sim_rate
        live_w, sim_w = {}, {}
        for wid, rec in self.monitor.workers.items():
            if rec.state is WorkerState.HEALTHY:
                book = self.leases.get((wid, rec.incarnation))
                live_w[wid] = (book.limit(), book.shortest_first_rate()) if book else (base, None)
                limit, sjf = self.sim_admitted.get(wid, (base, False))
                sim_w[wid] = (limit, rate if sjf else None)
        o, so = self.outage, self.sim_outage
        live = InForce(o.recovering, o.boost, live_w) if o else InForce(False, 1.0, live_w)
        return live, InForce(so.recovering and self.shaping, so.boost, sim_w)

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


DECISIONS = (tr.Route, tr.Recover, tr.Attempt, tr.Pairs)


async def replay(sim: Simulation, events: list[tr.Event]) -> Replayed:
    """Feed the trace to a `LiveShell`; what each side decided."""
    shell = LiveShell(sim)
    points: list[Point] = []
    changes: list[tuple[float, bool, float]] = []  # the live admission's (when, recovering, boost)
    at_end: dict[str, tuple[int, float | None]] = {}
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
        live, sim_now = shell.in_force()
        if (live.recovering, live.boost) != (changes[-1][1:] if changes else (False, 1.0)):
            changes.append((e.t, live.recovering, live.boost))
            if not live.recovering:
                at_end = live.workers  # every grant withdrawn at once, not left to expire
        if isinstance(e, DECISIONS):
            points.append(Point(e, live, sim_now))
    return Replayed(shell, shell.decisions, sorted(live_re), sorted(sim_re), points, changes, at_end)


@dataclass
class Replayed:
    shell: LiveShell
    decisions: list[Any]  # the live shell's decisions
    live_re: list[Any]  # holder reassignments: the live shell's
    sim_re: list[Any]  # ... the simulator's
    points: list[Point]  # the outage admission in force after every gateway decision
    changes: list[tuple[float, bool, float]]  # the live admission's (when, recovering, boost)
    at_end: dict[str, tuple[int, float | None]]  # each worker's admission as the live recovery ended


@dataclass(frozen=True, slots=True)
class Point:
    event: tr.Event  # a gateway decision (Route, Recover, Attempt, Pairs), just taken
    live: InForce
    sim: InForce


@pytest.mark.parametrize("mode", ["lumen", "lumen-cost", "fixed_checkpoint", "stop_restart"])
async def test_live_coordinator_takes_the_simulators_decisions(mode: str) -> None:
    sim, rec, _ = record(mode)
    events = rec.events
    expected = sim_decisions(events)
    kinds = {d[0] for d in expected}
    assert {"route", "recover", "attempt"} <= kinds, kinds
    out = await replay(sim, events)
    live, live_re, sim_re = out.decisions, out.live_re, out.sim_re
    for i, (a, b) in enumerate(zip(live, expected, strict=True)):
        assert a == b, f"decision {i}: live {a} != sim {b}"
    assert live_re == sim_re
    if sim.policy.checkpointing:
        assert sim_re, "the scenario must exercise holder reassignment"
        actions = {d[2] for d in expected if d[0] == "recover"}
        assert "restore" in actions, actions
    if sim.policy.draft_assist:
        assert any(d[0] == "pairs" and d[1] for d in expected), "the scenario must pair a drafter"


@pytest.mark.parametrize("mode", ["lumen", "lumen-cost", "fixed_checkpoint", "stop_restart"])
async def test_live_outage_admission_takes_the_simulators_boosts(mode: str) -> None:
    """The outage levers (issue 17) in both shells: the live `OutageAdmission`, started by the
    dispatcher's resume hook and ticked by heartbeats and state changes as in the gateway, grants
    through the control service what the simulator's `SimOutage` applies.

    "The same moment": (1) the recovery's changes (start, each new factor, end) are the same values
    in the same order at the same trace time; (2) after every gateway decision (route, recovery
    dispatch, attempt, pairing) the recovery, its factor, and each HEALTHY worker's batch limit and
    queue order in force (live: the lease book of the worker's incarnation, fed the SetAdmission
    messages sent) are the same; (3) at the end every grant is withdrawn (boost 1, FIFO) at once.
    Both judge with what the gateway knows: the simulator counts a worker out once the gateway has
    seen it fail (not when it was killed) and re-judges at every recovery dispatch as well as at its
    sampling tick, as the live gateway re-judges at every resume, heartbeat and state change."""
    sim, rec, _ = record(mode)
    out = await replay(sim, rec.events)
    coord, events = sim.coord, rec.events
    base = coord.outage.base_running
    sim_changes = [(e.t, e.recovering, e.boost) for e in events if isinstance(e, tr.Outage)]
    admitted = [e for e in events if isinstance(e, tr.Admission)]
    if not sim.policy.outage_admission:  # the baselines: no boost, FIFO; the live gateway sends nothing
        assert all(b == 1.0 for _, _, b in sim_changes) and not admitted
        assert out.shell.grants == 0 and out.changes == []
        assert all(p.live == p.sim for p in out.points)
        return
    # the scenario exercises a start, a raise to the cap, an end, and pairing under the boost
    assert [b for _, _, b in sim_changes] == [4 / 3, 1.5, 1.0] and not sim_changes[-1][1]
    assert any(isinstance(p.event, tr.Pairs) and p.event.pairs and p.sim.boost > 1 for p in out.points)
    assert out.shell.grants > 0

    # (1) the same changes at the same trace times
    assert out.changes == sim_changes

    # (2) the same admission in force after every gateway decision
    differ = [(i, p.event, p.live, p.sim) for i, p in enumerate(out.points) if p.live != p.sim]
    assert differ == [], differ[:3]
    assert len(out.points) > 2000

    # (3) the same end: every grant withdrawn when the live recovery ends
    live = out.shell.outage
    assert live is not None and not live.recovering and live.boost == 1.0
    assert out.at_end and set(out.at_end.values()) == {(base, None)}


async def test_both_shells_keep_the_batch_limit_on_a_prefill_bound_load() -> None:
    """The boost gate (core/outage.py `boost_gain`) in both shells: on a code-like load whose shape
    the gateway has measured, a failure starts a recovery (shortest prefill first) without a larger
    batch, live as in the simulator, at every decision."""
    sim, rec, _ = record("lumen", spec=CODE_SCENARIO)
    assert sim.coord.shape.ready and sim.coord.shape.output_tokens < 60
    out = await replay(sim, rec.events)
    sim_changes = [(e.t, e.recovering, e.boost) for e in rec.events if isinstance(e, tr.Outage)]
    assert sim_changes and sim_changes[0][1] and all(b == 1.0 for _, _, b in sim_changes)
    assert out.changes == sim_changes
    differ = [(i, p.event, p.live, p.sim) for i, p in enumerate(out.points) if p.live != p.sim]
    assert differ == [], differ[:3]
    assert any(p.sim.recovering and all(r is not None for _, r in p.sim.workers.values()) for p in out.points)
    # the same load with the gate off (boost_min_gain 0) boosts: the gate is what kept the limit
    spec = {**CODE_SCENARIO, "recovery": {**CODE_SCENARIO["recovery"], "outage_boost_min_gain": 0.0}}
    _, rec2, _ = record("lumen", spec=spec)
    assert any(e.boost > 1 for e in rec2.events if isinstance(e, tr.Outage))


def test_recording_does_not_change_the_run() -> None:
    scenario = parse_scenario(SCENARIO)
    w = scenario.workload
    workload = synthetic(np.random.default_rng(3), w.rate, w.duration_s)
    plain = Simulation(scenario, policy_for("lumen"), workload, 3).run()
    _, _, recorded = record("lumen")
    assert recorded.records == plain.records
    assert recorded.stats == plain.stats
