"""One simulated run: a scenario's cluster and workload in one recovery mode, with or without failures.

The event loop pops events in (time, sequence) order and hands them to the workers (engine steps,
restores) or to the gateway side (arrivals, failures, detection, restarts, periodic sampling).

Failure model: a killed worker loses its requests' KV and its capacity at once; the gateway detects
it `detection_s` later (requests it routes there meanwhile are lost too), dispatches every lost
request (or, in mode `none`, fails it), and restarts the worker as a new incarnation, whose reload
(`reloads.Reloads`: from disk or a seed survivor, with or without its draft model first) puts its
phases on the timeline. A `slow` failure multiplies one worker's step times without killing it (a
gray failure). A `hang` stops a worker as a kill does (its requests are lost with its KV), but
nothing breaks: the gateway sees only silence, and the detection time comes from the live gateway's
own verdict (`gateway.core.detector.hang_detection_s`: the worker's heartbeats every
`heartbeat_interval_s`, the detector's tick, its probe going unanswered, the correlated-silence
guard when most of the cluster hangs at once); the local supervisor then kills and restarts it
`hung_restart_grace_s` after that. A `capacity` failure is no fault but a bound: the worker's
capacity goes for its reload and nothing else is lost (gateway/sim/bound.py).
"""

from __future__ import annotations

import gc
import heapq
from collections.abc import Callable
from typing import Any, cast

from gateway.core.costmodel import CostModel
from gateway.core.detector import DetectorParams, hang_detection_s
from gateway.core.dispatch import DispatchParams
from gateway.core.evaluation import checkpoint_coverage, holder_balance
from gateway.core.health import WorkerState
from gateway.core.holders import HolderParams, ring_key
from gateway.core.modes import RecoveryPolicy
from gateway.core.outage import BoostGate, outage_params
from gateway.core.pairing import PairingParams
from gateway.core.types import LoadParams
from gateway.sim import events as ev
from gateway.sim.bound import vanish
from gateway.sim.coordinator import Coordinator, assist_gate, lag_per_token
from gateway.sim.events import EventQueue, pop_event, precedes
from gateway.sim.gray import SimGray
from gateway.sim.reloads import ActiveReload, Reloads, ReloadTimes
from gateway.sim.request import SimRequest
from gateway.sim.result import RunResult, RunStats, Sample
from gateway.sim.scenario import FailureSpec, Scenario
from gateway.sim.stepcost import StepCost
from gateway.sim.worker import SimWorker
from gateway.sim.workload import Workload

S = WorkerState


class Simulation:
    def __init__(
        self, scenario: Scenario, policy: RecoveryPolicy, workload: Workload, seed: int, failures: bool = True
    ) -> None:
        c, rec = scenario.cluster, scenario.recovery
        self.scenario, self.policy, self.seed = scenario, policy, seed
        self.cost = CostModel.preset(c.model, c.gpu, c.tp or None)
        draft_cost = CostModel.preset(c.draft_model, c.gpu)
        times = ReloadTimes(c, rec, self.cost, draft_cost)
        kv_capacity = c.kv_capacity_tokens or self.cost.kv_capacity_tokens()
        self.queue = EventQueue()
        step = StepCost(self.cost)
        restore_s = self.cost.restore_time(1)
        self.workers = [
            SimWorker(
                self,
                wid,
                scenario.domain_of(i),
                step,
                restore_s,
                c.max_running_requests,
                c.chunked_prefill_size,
                kv_capacity,
                c.ckpt_budget_bytes,
            )
            for i, wid in enumerate(scenario.worker_ids)
        ]
        load = LoadParams(rec.alpha, rec.beta, c.max_running_requests)
        exclude = rec.exclude_failure_domain and policy.placement == "load_aware"
        kvb = self.cost.model.kv_bytes_per_token
        self.coord = Coordinator(
            self.workers,
            policy,
            self.cost,
            load,
            HolderParams(load, rec.replicas, exclude, policy.placement, rec.stream_prefill),
            DispatchParams(load, policy.dispatch, rec.theta, rec.theta_mode, rec.tau, rec.service_steps),
            PairingParams(
                load,
                scenario.draft.hysteresis,
                scenario.draft.max_drafters_per_target,
                assist_gate(
                    scenario.draft,
                    self.cost,
                    draft_cost,
                    c.max_running_requests,
                    # the delay a draft-first restart costs against a plain one, and how long its
                    # drafter drafts (core/reload.py DraftFirst)
                    load_delay_s=times.draft_plan.delay_s,
                    assist_window_s=times.draft_plan.window_s,
                ),
            ),
            scenario.draft,
            StepCost(draft_cost),
            kvb,
            c.page_size,
            lag_per_token(kvb, self.cost.gpu.d2h_bw * self.cost.tp, c.network_bw),
            route_by_checkpoint_load=rec.route_by_checkpoint_load,
            outage=outage_params(rec),
            boost_gate=BoostGate(self.cost, c.max_running_requests, kv_capacity, c.chunked_prefill_size),
        )
        self.reloads = Reloads(times, rec.reload, policy, self.coord, self.queue)
        self.failures: tuple[FailureSpec, ...] = scenario.failures if failures else ()
        self.detector = DetectorParams(interval_s=rec.heartbeat_interval_s)
        self.hung: set[SimWorker] = set()  # hung, not yet restarted
        self.victims = scenario.victims(seed)
        self.tallies: dict[str, dict[str, int]] = {}
        self.coverage_flags: list[bool] = []
        self.balance: float | None = None
        self.balance_taken = False
        self.gray = SimGray(scenario.gray, self.coord, policy.failover)
        self.workload = workload
        self._arrivals = workload.arrivals.tolist()
        self._prompts = workload.prompts.tolist()
        self._outputs = workload.outputs.tolist()
        self.requests: list[SimRequest] = []
        self.open = 0
        self.gw_waiting: list[SimRequest] = []
        self.samples: list[Sample] = []
        self.now = 0.0

    # -- the loop ---------------------------------------------------------------------------------
    def run(self, progress: Callable[[float], None] | None = None) -> RunResult:
        q = self.queue
        # The arrivals are not pushed onto the heap: the next one waits here, as (time, sequence) with
        # the sequence number it would have had on the heap (taken when the previous arrival is
        # handled, as `push` would), so the events run in exactly the heap's (time, sequence) order.
        arrivals = self._arrivals
        n = len(arrivals)
        seq = q.seq
        ta, sa = (arrivals[0], next(seq)) if n else (0.0, 0)
        for i, f in enumerate(self.failures):
            q.push(f.at_s, ev.KILL, i)
        q.push(0.0, ev.TICK)
        # the hot loop: the heap and the commonest kinds as locals (a global or attribute lookup per
        # event is measurable at millions of events)
        heap, pop, compiled, step = q.heap, heapq.heappop, ev.COMPILED, ev.STEP
        events, i, t = 0, 0, self.now
        # No garbage collection during the run: its events, views and requests form no reference
        # cycles (all freed by reference counting), and the collector's passes over the growing set of
        # requests and records cost a few percent. The previous setting is restored after the run.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            while True:
                if i < n and precedes(ta, sa, heap):
                    t = ta
                    events += 1
                    r = SimRequest(i, t, self._prompts[i], self._outputs[i])
                    self.requests.append(r)
                    self.open += 1
                    i += 1
                    if i < n:
                        ta, sa = arrivals[i], next(seq)
                    if not self.coord.route(r, t):
                        self.wait_for_worker(r, t)
                elif heap:
                    t, _, kind, a, b = pop_event(heap) if compiled else pop(heap)
                    events += 1
                    if kind == step:
                        w = cast(SimWorker, a)  # (a direct call where compiled)
                        if b == w.version:  # else a stale plan (SimWorker.on_step would ignore it)
                            w.on_step(t, b)
                    else:
                        self._handle(kind, a, b, t)
                else:
                    break
                if not events & 4095 and progress is not None:
                    progress(t)
            self.now = t
            return self._result(events)
        finally:
            if gc_was_enabled:
                gc.enable()

    def _handle(self, kind: int, a: Any, b: Any, t: float) -> None:
        """Every event but an arrival and a decode step (the loop handles those inline)."""
        if kind == ev.RESTORED:
            r, inc = b
            if a.incarnation == inc and r in a.restoring:
                a.on_restored(r, t)
        elif kind == ev.TICK:
            self._tick(t)
        elif kind == ev.KILL:
            self._strike(a, t)
        elif kind == ev.DETECT:
            self._detect(a, t)
        elif kind == ev.PHASE:
            self._phase(a, b, t)
        elif kind == ev.GIVE_UP and a in self.gw_waiting:
            self.gw_waiting.remove(a)
            self._fail(a, t)
        elif kind == ev.SEED:
            self.reloads.seed_sends(a, b, t)
        elif kind == ev.RESTART:
            self._restart_hung(a, b, t)

    def _tick(self, now: float) -> None:
        self.samples.append(
            (
                now,
                [w.running + len(w.waiting) if w.alive else 0 for w in self.workers],
                [w.ckpt_tokens for w in self.workers],
            )
        )
        if self.scenario.gray.enabled:
            self.gray.check(self.workers, now, self._move)
        self.coord.repair(now)
        if self.open or len(self.requests) < len(self._arrivals):
            self.queue.push(now + self.scenario.sample_s, ev.TICK)

    def _move(self, r: SimRequest, w: SimWorker, now: float) -> None:
        """A degraded worker's request resumes elsewhere through recovery dispatch (or waits)."""
        self._interrupt(r)
        if not self.coord.recover(r, w, now):
            self.wait_for_worker(r, now)

    # -- engine callbacks (EngineHost) --------------------------------------------------------------
    def on_prefilled(self, r: SimRequest, now: float) -> None:
        r.emitted += 1
        if r.first_token is None:
            r.first_token = now
        if r.awaiting_resume:
            r.awaiting_resume = False
            if r.last_before is not None:
                r.resume_delay = now - r.last_before
        r.last_token = now
        self.coord.stream_from(r, now, r.prompt + r.emitted - 1)  # r.context - 1

    def on_finished(self, r: SimRequest, now: float) -> None:
        r.done = True
        r.last_token = now
        self.coord.shape.observe(r.prompt, r.output)
        self.coord.release(r)
        self.open -= 1

    def on_rejected(self, r: SimRequest, now: float) -> None:
        self._fail(r, now)  # larger than a worker's whole KV cache

    def _fail(self, r: SimRequest, now: float) -> None:
        r.error = True
        r.done = True
        self.coord.release(r)
        self.open -= 1

    def wait_for_worker(self, r: SimRequest, now: float) -> None:
        """No HEALTHY worker: wait at the gateway for one (live gateway: `no_worker_wait_s`)."""
        r.worker = None
        self.gw_waiting.append(r)
        self.queue.push(now + self.scenario.recovery.no_worker_wait_s, ev.GIVE_UP, r)

    # -- failures ---------------------------------------------------------------------------------
    def _strike(self, index: int, now: float) -> None:
        f = self.failures[index]
        ids = self.victims[index] or [self._top_holder(f.holder_of)]
        victims = [self.coord.by_id[wid] for wid in ids if self.coord.by_id[wid].alive]
        if f.kind == "slow":
            for w in victims:
                w.set_slowdown(f.slowdown, now)
            return
        if f.kind == "capacity":
            vanish(self, victims, now)
            return
        if not self.balance_taken and self.policy.checkpointing:
            self.balance_taken = True
            self.balance = holder_balance(w.ckpt_tokens for w in self.workers if w.state is S.HEALTHY)
        dead = set(victims)
        self.reloads.struck(victims, now)
        for w in victims:
            self.coord.freeze(w)
            tally: dict[str, int] = {}
            running = [*w.batch.members.values(), *w.prefill_q, *w.restoring]
            for r in running:
                r.durable = self.coord.durable_at(r, now)
                self.coverage_flags.append(self.coord.has_live_checkpoint(r, dead))
                for h in r.holders:
                    tally[h.id] = tally.get(h.id, 0) + 1
            self.tallies[w.id] = tally
            for r in w.kill(now):
                self._interrupt(r)
        if f.kind == "hang":
            self.hung.update(victims)
            detect_at = now + self._hang_detection(len(victims), now)
        else:
            detect_at = now + self.scenario.recovery.detection_s
        self.queue.push(detect_at, ev.DETECT, tuple((w, w.incarnation) for w in victims))

    def _hang_detection(self, hung: int, now: float) -> float:
        """Seconds from `hung` workers stopping at `now` to FAILED, by the live gateway's verdict:
        heartbeats on the interval grid (the last one `now mod interval` ago), the others beating."""
        others = sum(1 for w in self.workers if w.alive)  # the hung ones are not alive any more
        interval = self.detector.interval_s
        return hang_detection_s(self.detector, phase_s=now % interval, others=others, hung=hung)

    @staticmethod
    def _interrupt(r: SimRequest) -> None:
        r.interrupted = True
        r.awaiting_resume = True
        r.last_before = r.last_token

    def _top_holder(self, of: str) -> str:
        """The worker that held most of `of`'s checkpoints when it failed (its ring successor if none)."""
        tally = self.tallies.get(of, {})
        if tally:
            return min(tally, key=lambda h: (-tally[h], ring_key(h)))
        ids = sorted(self.coord.by_id, key=ring_key)
        return ids[(ids.index(of) + 1) % len(ids)]

    def _detect(self, group: tuple[tuple[SimWorker, int], ...], now: float) -> None:
        failed = [w for w, inc in group if w.incarnation == inc and not w.alive]
        coord = self.coord
        for w in failed:
            coord.set_state(w, S.FAILED)
        for w in failed:
            coord.holder_failed(w, now)
        lost: list[tuple[SimRequest, SimWorker]] = []
        for w in failed:
            for r in w.lost[w.lost_at_kill :]:  # routed to it after it died: lost as well
                self._interrupt(r)
            lost.extend((r, w) for r in w.lost)
            w.lost, w.lost_at_kill = [], 0
        lost.sort(key=lambda x: x[0].rid)
        for r, w in lost:
            if r.done:
                continue
            if not self.policy.failover:
                self._fail(r, now)
            elif not coord.recover(r, w, now):
                self.wait_for_worker(r, now)
        if not self.scenario.recovery.restart:
            return
        for w in failed:
            if w in self.hung:  # its process is still there, silent: killed after the grace
                grace = self.scenario.recovery.hung_restart_grace_s
                self.queue.push(now + grace, ev.RESTART, w, w.incarnation)
                continue
            w.restart()
            coord.set_state(w, S.RESTARTING)
            self.reloads.start(w, now)

    def _restart_hung(self, w: SimWorker, incarnation: int, now: float) -> None:
        if w.incarnation != incarnation or w not in self.hung:
            return
        self.hung.discard(w)
        w.restart()
        self.coord.set_state(w, S.RESTARTING)
        self.reloads.start(w, now)

    def _phase(self, w: SimWorker, b: tuple[int, WorkerState, ActiveReload, int], now: float) -> None:
        """A restarting worker reaches a phase of its reload (DRAFT_READY, HEALTHY)."""
        incarnation, state, rl, gen = b
        if w.incarnation != incarnation or not w.alive:
            return
        if not self.reloads.reached(w, state, rl, gen, now):
            return  # superseded: the seed was lost, the weights come from disk later
        self.coord.set_state(w, state)
        self.coord.repair(now)
        if state is S.HEALTHY and self.gw_waiting:
            waiting, self.gw_waiting = self.gw_waiting, []
            for r in waiting:
                if not self.coord.route(r, now):
                    self.gw_waiting.append(r)

    # -- results ------------------------------------------------------------------------------------
    def _result(self, events: int) -> RunResult:
        if self.open:
            raise RuntimeError(f"{self.open} requests neither completed nor failed")  # conservation
        ks = self.coord.spec_ks
        stats = RunStats(
            restores=self.coord.decisions["restore"],
            replays=self.coord.decisions["replay"],
            restored_tokens=self.coord.restored_tokens,
            coverage=checkpoint_coverage(self.coverage_flags) if self.policy.checkpointing else None,
            holder_balance=self.balance,
            acceptance_rate=self.scenario.draft.agreement if ks else None,
            draft_k_mean=sum(ks) / len(ks) if ks else None,
            pairings=len(ks),
            events=events,
            degradations=self.gray.degradations,
            reloads=self.reloads.records(),
            boosts=tuple(self.coord.outage.judgements),
        )
        return RunResult.collect(
            self.requests, self.failures, self.now, [w.id for w in self.workers], self.samples, stats
        )
