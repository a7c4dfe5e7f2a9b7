"""When a starting worker changes phase: its model-load plan (DESIGN 1.3, 5), as data.

A first start serves at once (the fleet is assumed warm). A restart pays the full model's load time
(`model_load_s`, else the cost model's weights / load bandwidth + engine start-up) before SERVING. A
restart with a draft model loads the draft first: LOADING_DRAFT until the draft model's own load time
(`draft_load_s`, else the draft preset's cost-model load time), then DRAFT_READY (it drafts for a
survivor), then SERVING once the full weights followed it from the same storage: the draft's weights
time later than a plain restart (`gateway.core.reload.DraftFirst`, the timeline the simulator uses and
the draft-assist gate charges). A draft model that would not be ready before the full one is not worth
loading: such a restart is a plain LOADING_FULL one; and so is one whose gateway answers its Hello
with `skip_draft` (the gate says drafting would not make up for the later start): `plain_plan`.
`walk_plan` is the restart's task that changes the engine's phase on the plan's times (re-read
when the engine replaces its plan: `Engine.replan`).

A seeded restart (`EngineSpec.reload_from_peer`, seeding.py) takes the full weights from a running
peer once the gateway names one: the same plans with the peer's load time (`peer_load_s`, else the
cost model's, start-up included), the draft model still from storage (the simulator's timeline,
gateway/sim/reloads.py): a draft loaded first is ready at its own load time and the full model serves
the peer transfer later. A seed lost mid-way leaves the rest of the weights to storage
(`fallback_plan`).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from gateway.core.costmodel import CostModel, ReloadSource
from gateway.core.health import Phase
from gateway.core.reload import DraftFirst, seeded_draft_first_serving_s
from gateway.protocol.launch import EngineSpec

if TYPE_CHECKING:
    from worker_hooks.engine.engine import Engine

log = structlog.get_logger("worker_hooks.engine.engine")  # the engine's own log: the phases are its


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """The phase at start, then (wall seconds from start, phase) in time order."""

    first: Phase
    changes: tuple[tuple[float, Phase], ...] = ()

    @property
    def drafts(self) -> bool:
        """Whether the worker goes through DRAFT_READY (and so runs a drafter)."""
        return any(phase is Phase.DRAFT_READY for _, phase in self.changes)

    @property
    def serving_s(self) -> float:
        """When the plan serves, wall seconds from its start (0: at once)."""
        return max((at for at, phase in self.changes if phase is Phase.SERVING), default=0.0)


def _full_load_s(spec: EngineSpec, cost: CostModel, source: ReloadSource = ReloadSource.DISK) -> float:
    if source is ReloadSource.PEER:
        return spec.peer_load_s if spec.peer_load_s is not None else cost.load_time(source=ReloadSource.PEER)
    return spec.model_load_s if spec.model_load_s is not None else cost.load_time()


def peer_weights_s(spec: EngineSpec, cost: CostModel) -> float:
    """The transfer from a seed, modelled seconds: the last part of a peer load, never all of more."""
    return min(cost.weights_time(ReloadSource.PEER), _full_load_s(spec, cost, ReloadSource.PEER))


def plain_plan(spec: EngineSpec, cost: CostModel, source: ReloadSource = ReloadSource.DISK) -> LoadPlan:
    """A restart without its draft model: LOADING_FULL, then SERVING after the full model's load."""
    if not spec.restart:
        return LoadPlan(Phase.SERVING)
    at = _full_load_s(spec, cost, source) * spec.time_scale
    return LoadPlan(Phase.LOADING_FULL, ((at, Phase.SERVING),))


def load_plan(spec: EngineSpec, cost: CostModel, source: ReloadSource = ReloadSource.DISK) -> LoadPlan:
    """The plan for `spec` with the full weights from `source`; `cost` is the full model's cost
    model. Times are scaled by time_scale."""
    if not spec.restart or not spec.draft_model:
        return plain_plan(spec, cost, source)
    full = _full_load_s(spec, cost, source)
    drafter = CostModel.preset(spec.draft_model, spec.gpu)
    draft_s = spec.draft_load_s if spec.draft_load_s is not None else drafter.load_time()
    if draft_s >= full:  # core draft_first: worth loading first only if ready first
        return plain_plan(spec, cost, source)
    scale = spec.time_scale
    if source is ReloadSource.PEER:  # the draft from storage, then the weights from the seed
        ready, serving = draft_s, seeded_draft_first_serving_s(draft_s, peer_weights_s(spec, cost), full)
    else:
        t = DraftFirst(full, draft_s, drafter.weights_time())
        ready, serving = t.draft_load_s, t.serving_s
    return LoadPlan(
        Phase.LOADING_DRAFT, ((ready * scale, Phase.DRAFT_READY), (serving * scale, Phase.SERVING))
    )


def fallback_plan(spec: EngineSpec, cost: CostModel, phase: Phase, elapsed_s: float) -> LoadPlan:
    """A seeded restart whose seed was lost `elapsed_s` (wall) into its load: the rest of the weights
    from storage (no second start-up), in the phase it is in until it serves."""
    weights = min(cost.weights_time(), _full_load_s(spec, cost))
    return LoadPlan(phase, ((elapsed_s + weights * spec.time_scale, Phase.SERVING),))


async def walk_plan(engine: Engine) -> None:
    """Walk `engine`'s load plan, changing its phase on time (re-read if `Engine.skip_draft` replaces
    the plan); once serving, retire the drafter (after its pairs and rounds end)."""
    loop = asyncio.get_running_loop()
    start = engine.load_started = loop.time()
    log.info("loading model", worker_id=engine.worker_id, plan=engine.load_plan)
    torch = engine.torch
    done = 0  # phase changes of the current plan taken
    loaded: set[Phase] = set()  # the torch loads done (a replanned phase is not loaded twice)
    while done < len(engine.load_plan.changes):
        plan = engine.load_plan
        at, phase = plan.changes[done]
        engine.replanned.clear()  # before the loads: a replan during one is seen at once
        if torch is not None and phase not in loaded:  # real loads; the plan's times are minimums
            if phase is Phase.DRAFT_READY and engine.assist.drafter is not None:
                engine.assist.drafter.set_model(await torch.load_draft_async())
            elif phase is Phase.SERVING:
                await torch.load_target_async()
            loaded.add(phase)
        wait = start + at - loop.time()
        if wait > 0 and engine.load_plan is plan:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(engine.replanned.wait(), wait)
        if engine.load_plan is not plan:  # replanned while waiting: from its first change
            done = 0
            continue
        done += 1
        if engine.phase in (Phase.DRAINING, Phase.SERVING):
            break  # drained while loading: stays so
        if phase is Phase.DRAFT_READY and engine.assist.drafter is not None:
            engine.assist.drafter.set_ready()
        engine.phase = phase
        log.info("phase", worker_id=engine.worker_id, phase=phase.value, incarnation=engine.incarnation)
        if phase is Phase.SERVING:
            engine.seeding.served(loop.time() - start)
    if engine.assist.drafter is not None:
        await engine.assist.drafter.retire()
