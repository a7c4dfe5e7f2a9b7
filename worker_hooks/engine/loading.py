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
`walk_plan` is the restart's task that changes the engine's phase on the plan's times.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from gateway.core.costmodel import CostModel
from gateway.core.health import Phase
from gateway.core.reload import DraftFirst
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


def _full_load_s(spec: EngineSpec, cost: CostModel) -> float:
    return spec.model_load_s if spec.model_load_s is not None else cost.load_time()


def plain_plan(spec: EngineSpec, cost: CostModel) -> LoadPlan:
    """A restart without its draft model: LOADING_FULL, then SERVING after the full model's load."""
    if not spec.restart:
        return LoadPlan(Phase.SERVING)
    return LoadPlan(Phase.LOADING_FULL, ((_full_load_s(spec, cost) * spec.time_scale, Phase.SERVING),))


def load_plan(spec: EngineSpec, cost: CostModel) -> LoadPlan:
    """The plan for `spec`; `cost` is the full model's cost model. Times are scaled by time_scale."""
    if not spec.restart or not spec.draft_model:
        return plain_plan(spec, cost)
    full = _full_load_s(spec, cost)
    drafter = CostModel.preset(spec.draft_model, spec.gpu)
    draft_s = spec.draft_load_s if spec.draft_load_s is not None else drafter.load_time()
    if draft_s >= full:
        return plain_plan(spec, cost)
    t = DraftFirst(full, draft_s, drafter.weights_time())
    scale = spec.time_scale
    return LoadPlan(
        Phase.LOADING_DRAFT,
        ((t.draft_load_s * scale, Phase.DRAFT_READY), (t.serving_s * scale, Phase.SERVING)),
    )


async def walk_plan(engine: Engine) -> None:
    """Walk `engine`'s load plan, changing its phase on time (re-read if `Engine.skip_draft` replaces
    the plan); once serving, retire the drafter (after its pairs and rounds end)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    log.info("loading model", worker_id=engine.worker_id, plan=engine.load_plan)
    torch = engine.torch
    done = 0  # phase changes of the current plan taken
    while done < len(engine.load_plan.changes):
        plan = engine.load_plan
        at, phase = plan.changes[done]
        if torch is not None:  # real loads; the plan's times are minimums
            if phase is Phase.DRAFT_READY and engine.assist.drafter is not None:
                engine.assist.drafter.set_model(await torch.load_draft_async())
            elif phase is Phase.SERVING:
                await torch.load_target_async()
        engine.replanned.clear()
        wait = start + at - loop.time()
        if wait > 0:
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
    if engine.assist.drafter is not None:
        await engine.assist.drafter.retire()
