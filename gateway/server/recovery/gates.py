"""The cost gates of the recovery levers, built from a gateway's config (issue 17): draft assist's
(`speculation.AssistGate`) and the outage boost's (`outage.BoostGate`). Both judge a worker as the
config sizes it, with the target model's cost model."""

from __future__ import annotations

from gateway.config import Config, draft_for
from gateway.core.costmodel import MODELS, CostModel
from gateway.core.outage import BoostGate
from gateway.core.reload import DraftFirst
from gateway.core.speculation import AssistGate


def assist_gate(config: Config, cost: CostModel) -> AssistGate | None:
    """Draft assist's cost gate (None: `draft.assist_gate` off): the target's cost model and, when the
    paired draft model is a cost-model preset, the drafter's (its latency is then charged to every
    round, and a draft-first restart's timeline, core/reload.py DraftFirst, to the choice to load it)."""
    d = config.draft
    if not d.assist_gate:
        return None
    name = draft_for(d.pairs, config.model.preset)
    drafter = CostModel.preset(name, config.model.gpu) if name in MODELS else None
    delay = window = 0.0
    if drafter is not None:
        e = config.engine
        plan = DraftFirst(
            e.model_load_s if e.model_load_s >= 0 else cost.load_time(),
            e.draft_load_s if e.draft_load_s >= 0 else drafter.load_time(),
            drafter.weights_time(),
        )
        delay, window = plan.delay_s, plan.window_s
    return AssistGate(
        cost,
        drafter,
        d.agreement,
        d.k_min,
        d.k_max,
        min_gain=d.assist_min_gain,
        min_waiting=d.assist_min_waiting,
        nominal_batch=config.engine.max_running_requests,
        load_delay_s=delay,
        assist_window_s=window,
    )


def boost_gate(config: Config, cost: CostModel) -> BoostGate:
    """The outage boost's cost gate: a worker as the engine section sizes it."""
    e = config.engine
    kv = e.kv_capacity_tokens or cost.kv_capacity_tokens()
    return BoostGate(cost, e.max_running_requests, kv, e.chunked_prefill_size)
