"""When a starting worker changes phase: its model-load plan (DESIGN 1.3, 5), as data.

A first start serves at once (the fleet is assumed warm). A restart pays the full model's load time
(`model_load_s`, else the cost model's weights / load bandwidth + engine start-up) before SERVING. A
restart with a draft model loads both models concurrently from the start: LOADING_DRAFT until the
draft model's own load time (`draft_load_s`, else the draft preset's cost-model load time), then
DRAFT_READY (it drafts for a survivor), then SERVING when the full model is in, at the same moment a
restart without a draft model would serve. The draft model's few GB are assumed not to slow the full
model's load noticeably; running them one after the other would delay full serving by the draft's
load time, which is the stall progressive recovery exists to avoid. A draft model that would not be
ready before the full one is not worth loading: such a restart is a plain LOADING_FULL one.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.core.costmodel import CostModel
from gateway.core.health import Phase
from gateway.protocol.launch import EngineSpec


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """The phase at start, then (wall seconds from start, phase) in time order."""

    first: Phase
    changes: tuple[tuple[float, Phase], ...] = ()

    @property
    def drafts(self) -> bool:
        """Whether the worker goes through DRAFT_READY (and so runs a drafter)."""
        return any(phase is Phase.DRAFT_READY for _, phase in self.changes)


def load_plan(spec: EngineSpec, cost: CostModel) -> LoadPlan:
    """The plan for `spec`; `cost` is the full model's cost model. Times are scaled by time_scale."""
    if not spec.restart:
        return LoadPlan(Phase.SERVING)
    full = (spec.model_load_s if spec.model_load_s is not None else cost.load_time()) * spec.time_scale
    if spec.draft_model:
        draft_s = spec.draft_load_s
        if draft_s is None:
            draft_s = CostModel.preset(spec.draft_model, spec.gpu).load_time()
        draft = draft_s * spec.time_scale
        if draft < full:
            return LoadPlan(Phase.LOADING_DRAFT, ((draft, Phase.DRAFT_READY), (full, Phase.SERVING)))
    return LoadPlan(Phase.LOADING_FULL, ((full, Phase.SERVING),))
