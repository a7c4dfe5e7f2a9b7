"""Restarts' reloads in the simulator: how long each phase takes, where the weights come from, and
what is recorded (`result.Reload`). The simulation (`simulation.Simulation`) asks for a reload when
it restarts a worker, and applies the phases this module puts on the event queue.

A restart loads the full model (`full_load_s`), or with draft assist the draft model first
(DRAFT_READY: it drafts for the survivor Algorithm 3 picks) and then the full weights with no second
engine start.

Seeded reload (`recovery.reload = "peer"`, issue 14): when the restart is launched, the core picks a
seed survivor (`gateway.core.reload.choose_seed`: HEALTHY, not sending to another restart, least
`L̂`, ties by id) and the full weights come from it at `peer_bw` per GPU instead of from disk; no
seed: disk. The transfer is the last part of the load, ending when the full model serves, and for
its duration the seed's steps are `seed_slowdown` times slower. The draft model always comes from
disk (no survivor holds it: survivors serve only the target), and a restart loads it first only if
it would be ready before the full model (`draft_first`), which a seeded full model usually beats. A
seed lost before or during its transfer makes the restart load the weights from disk from then on
(no second engine start-up: optimistic for SGLang, whose failed load would restart the process).
Every reload is recorded: source, seed, phases, seconds.
"""

from __future__ import annotations

from gateway.core.costmodel import CostModel, ReloadSource
from gateway.core.health import WorkerState
from gateway.core.modes import RecoveryPolicy
from gateway.core.reload import SEED_LOST_SOURCE, DraftFirst, draft_first, seeded_draft_first_serving_s
from gateway.sim import events as ev
from gateway.sim.coordinator import Coordinator
from gateway.sim.events import EventQueue
from gateway.sim.result import Reload
from gateway.sim.scenario import ClusterSpec, RecoverySpec
from gateway.sim.worker import SimWorker

S = WorkerState


class ReloadTimes:
    """The seconds a restart's phases take, from the cost models or the scenario's overrides."""

    __slots__ = (
        "after_draft_s",
        "draft_load_s",
        "draft_plan",
        "full_load_s",
        "peer_load_s",
        "peer_weights_s",
        "seed_slowdown",
        "weights_load_s",
    )

    def __init__(self, c: ClusterSpec, rec: RecoverySpec, cost: CostModel, draft_cost: CostModel) -> None:
        self.full_load_s = c.model_load_s if c.model_load_s >= 0 else cost.load_time()
        self.draft_load_s = c.draft_load_s if c.draft_load_s >= 0 else draft_cost.load_time()
        self.weights_load_s = cost.load_time(engine_startup_s=0.0)  # a broken seed's rest: no restart
        # a restart that loads its draft first (core/reload.py DraftFirst, as Lumen's worker plans
        # it): the full model serves the draft's weights later than a plain restart, and this long
        # after the draft is ready
        self.draft_plan = DraftFirst(self.full_load_s, self.draft_load_s, draft_cost.weights_time())
        self.after_draft_s = self.draft_plan.window_s
        # seeded reload: the same with the weights from a survivor
        peer_bw = c.peer_bw or None
        self.peer_weights_s = cost.weights_time(ReloadSource.PEER, peer_bw)
        self.peer_load_s = (
            c.peer_load_s if c.peer_load_s >= 0 else cost.load_time(source=ReloadSource.PEER, peer_bw=peer_bw)
        )
        self.seed_slowdown = rec.seed_slowdown or cost.seed_slowdown(peer_bw)


class ActiveReload:
    """A restart's reload as it happens (`result.Reload` once the run ends)."""

    __slots__ = (
        "draft_first",
        "draft_ready_s",
        "gen",
        "incarnation",
        "seed",
        "serving_s",
        "slowing",
        "source",
        "started_s",
        "transfer_s",
        "transfer_start",
        "worker",
    )

    def __init__(self, worker: SimWorker, now: float, seed: SimWorker | None, first: bool) -> None:
        self.worker, self.incarnation, self.started_s = worker, worker.incarnation, now
        self.seed, self.draft_first = seed, first
        self.source = ReloadSource.PEER.value if seed is not None else ReloadSource.DISK.value
        self.draft_ready_s: float | None = None
        self.serving_s: float | None = None
        self.transfer_s = 0.0
        self.transfer_start = now
        self.slowing = False  # the seed's steps are slowed now
        self.gen = 0  # the HEALTHY event of this generation is the live one (a fallback moves it)

    def record(self) -> Reload:
        return Reload(
            self.worker.id,
            self.incarnation,
            self.started_s,
            self.source,
            None if self.seed is None else self.seed.id,
            self.draft_first,
            self.draft_ready_s,
            self.serving_s,
            self.transfer_s,
        )


class Reloads:
    """Every reload of a run: launched (`start`), struck by kills (`struck`), reaching its phases
    (`reached`), and their seeds' slowdowns (`seed_sends`)."""

    def __init__(
        self,
        times: ReloadTimes,
        source: ReloadSource,
        policy: RecoveryPolicy,
        coord: Coordinator,
        queue: EventQueue,
    ) -> None:
        self.times, self.source, self.policy, self.coord, self.queue = times, source, policy, coord, queue
        self.all: list[ActiveReload] = []
        self.reloading: dict[SimWorker, ActiveReload] = {}  # restarting worker -> its reload
        self.sending: dict[SimWorker, ActiveReload] = {}  # seed -> the reload it is reserved for

    def records(self) -> tuple[Reload, ...]:
        return tuple(rl.record() for rl in self.all)

    def start(self, w: SimWorker, now: float) -> None:
        """Launch w's reload: its seed (peer reload) or disk, then its phases on the timeline."""
        t = self.times
        seed = None
        if self.source == ReloadSource.PEER:
            seed = self.coord.choose_seed(w, [s.id for s in self.sending])
        full = t.full_load_s if seed is None else t.peer_load_s
        # the draft first only if it would be ready first and the cost gate would pair it now
        first = self.policy.draft_assist and draft_first(t.draft_load_s, full) and self.coord.assist_wanted()
        rl = ActiveReload(w, now, seed, first)
        self.all.append(rl)
        self.reloading[w] = rl
        inc, q = w.incarnation, self.queue
        if first:
            ready = now + t.draft_load_s
            q.push(ready, ev.PHASE, w, (inc, S.DRAFT_READY, rl, 0))
            serving = (
                ready + t.after_draft_s
                if seed is None
                else now + seeded_draft_first_serving_s(t.draft_load_s, t.peer_weights_s, t.peer_load_s)
            )
        else:
            serving = now + full
        if seed is not None:
            self.sending[seed] = rl
            rl.transfer_s = min(t.peer_weights_s, serving - now)  # the weights come last
            rl.transfer_start = serving - rl.transfer_s
            q.push(rl.transfer_start, ev.SEED, rl, 0)
        q.push(serving, ev.PHASE, w, (inc, S.HEALTHY, rl, 0))

    def seed_sends(self, rl: ActiveReload, gen: int, now: float) -> None:
        """A SEED event: the transfer begins, the seed slows down (unless it was superseded)."""
        seed = rl.seed
        if rl.gen == gen and seed is not None and self.sending.get(seed) is rl and seed.alive:
            rl.slowing = True
            seed.set_send_slowdown(self.times.seed_slowdown, now)

    def _end_transfer(self, rl: ActiveReload, now: float) -> None:
        seed = rl.seed
        if seed is not None and self.sending.get(seed) is rl:
            del self.sending[seed]
            if rl.slowing and seed.alive:
                seed.set_send_slowdown(1.0, now)
        rl.slowing = False

    def struck(self, victims: list[SimWorker], now: float) -> None:
        """Kills among reloads: a killed restart frees its seed; a killed seed's restart falls back."""
        if not self.reloading:
            return
        for w in victims:
            rl = self.reloading.pop(w, None)
            if rl is not None:  # killed while loading: its events die with its incarnation
                self._end_transfer(rl, now)
        for w in victims:
            rl = self.sending.pop(w, None)
            if rl is None:
                continue
            # the transfer breaks (or never starts): the rest of the weights come from disk
            rl.gen += 1
            rl.slowing = False
            rl.source = SEED_LOST_SOURCE
            rl.transfer_s = max(0.0, now - rl.transfer_start)
            serving = max(now, rl.transfer_start) + self.times.weights_load_s
            r = rl.worker
            self.queue.push(serving, ev.PHASE, r, (rl.incarnation, S.HEALTHY, rl, rl.gen))

    def reached(self, w: SimWorker, state: WorkerState, rl: ActiveReload, gen: int, now: float) -> bool:
        """A PHASE event of w's live incarnation: record it; False when it was superseded (the seed was
        lost, the weights come from disk later)."""
        if state is S.HEALTHY:
            if gen != rl.gen:
                return False
            rl.serving_s = now
            self._end_transfer(rl, now)
            if self.reloading.get(w) is rl:
                del self.reloading[w]
        elif state is S.DRAFT_READY:
            rl.draft_ready_s = now
        return True
