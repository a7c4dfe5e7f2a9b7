"""Draft-assist pairing: which overloaded survivor each recovering worker drafts for (Algorithm 3).

A restarting worker that has loaded its draft model (DRAFT_READY) becomes a speculative-decoding
drafter for a HEALTHY survivor until its full model is loaded. Rules:

- Targets are the HEALTHY workers that are loaded (`L̂(t) > 0`) and not below the mean `L̂` of all
  HEALTHY workers. "Not below" rather than "above": a lone survivor, or survivors sharing the load
  evenly, are exactly the workers a drafter should help, and a strict test would never pair them.
  A pair is dropped when its target falls more than `hysteresis` below the mean or goes idle (the
  margin that also stops re-pairing from flapping). A drafter is never a target.
- A current pair is kept while its drafter is DRAFT_READY and its target is still a target.
- Free drafters, in id order, go to the most loaded target with room (`max_drafters_per_target`),
  so with no current pairs the most loaded survivor gets the first drafter.
- Hysteresis: a kept drafter moves only to a target with room whose load exceeds its current
  target's by more than `hysteresis` (additive, in `L̂` units). Moves repeat until none applies, so
  feeding the result back in as `current` returns it unchanged.
- The cost gate (issue 17, `PairingParams.gate`, `speculation.assist_pays`): a target is paired
  only if it is overloaded (requests waiting) and the cost model says drafting makes it complete
  requests faster (drafter latency, the target's batch and the prefill of the requests that take
  the freed slots modelled); a current pair is kept while the speed-up alone holds (no flapping as
  the queue empties and refills). Without a gate every target is eligible (the paper's Algorithm 3).
- A restart loads its draft model first only if that pays (`draft_first_pays`): some target would
  be paired now, and what drafting for it adds over the assist window outweighs what loading the
  draft first delays the full model by (`speculation.load_pays`).
Ties between equal loads go to the smaller id; the result does not depend on the order of the view,
of `drafters`, or of `current`.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace

from gateway.core.health import SERVING_STATES, WorkerState
from gateway.core.load import estimated_load
from gateway.core.loadshape import LoadShape
from gateway.core.speculation import AssistGate, assist_pays, load_pays, view_gain
from gateway.core.types import ClusterView, LoadParams, WorkerId, check


@dataclass(frozen=True, slots=True)
class PairingParams:
    load: LoadParams = field(default_factory=LoadParams)
    hysteresis: float = 0.25
    max_drafters_per_target: int = 1
    # draft only where the cost model says it pays (None: wherever Algorithm 3 says)
    gate: AssistGate | None = None

    def __post_init__(self) -> None:
        ok = self.hysteresis >= 0 and math.isfinite(self.hysteresis)
        check(ok, "hysteresis", self.hysteresis, "must be a finite number >= 0")
        n = self.max_drafters_per_target
        check(n >= 1, "max_drafters_per_target", n, "must be >= 1")


def draft_targets(
    view: ClusterView, params: PairingParams, exclude: Collection[WorkerId] = ()
) -> list[tuple[float, WorkerId]]:
    """(L̂, id) of every HEALTHY worker not in `exclude` with 0 < L̂ >= the HEALTHY mean, most loaded first."""
    loads = {w.id: estimated_load(w, params.load) for w in view.workers.values() if w.state in SERVING_STATES}
    if not loads:
        return []
    # fsum is exactly rounded, so the mean does not depend on the order of the view
    mean = math.fsum(loads.values()) / len(loads)
    out = [(load, wid) for wid, load in loads.items() if load > 0 and load >= mean and wid not in exclude]
    if params.gate is not None:
        gate = params.gate
        out = [(load, wid) for load, wid in out if assist_pays(gate, view.workers[wid])]
    out.sort(key=lambda t: (-t[0], t[1]))
    return out


def with_batch_limit(params: PairingParams, limit: int) -> PairingParams:
    """`params` with its gate judging targets at batch limit `limit`: the one in force while an
    outage boost lasts (core/outage.py), so that a restart's draft-first choice and the pairing
    after it judge the batch the survivors actually run."""
    gate = params.gate
    if gate is None or gate.nominal_batch in (0, limit):  # 0: the gate counts any queue as waiting
        return params
    return dataclasses.replace(params, gate=dataclasses.replace(gate, nominal_batch=limit))


def with_load_shape(params: PairingParams, shape: LoadShape, tolerance: float = 0.05) -> PairingParams:
    """`params` with its gate judging the load's shape as measured (`loadshape.LoadShape`); the same
    object while both means are within `tolerance` of the gate's (decisions do not churn on noise)."""
    gate = params.gate
    if gate is None or gate.prompt_tokens == 0 or not shape.ready:  # 0: leaves prefill out on purpose
        return params
    p, o = shape.prompt_tokens, shape.output_tokens
    if abs(p - gate.prompt_tokens) <= tolerance * max(1.0, gate.prompt_tokens) and abs(
        o - gate.output_tokens
    ) <= tolerance * max(1.0, gate.output_tokens):
        return params
    return dataclasses.replace(params, gate=dataclasses.replace(gate, prompt_tokens=p, output_tokens=o))


def draft_first_pays(view: ClusterView, params: PairingParams, exclude: Collection[WorkerId] = ()) -> bool:
    """Whether a restart (`exclude` it: it is not a target) should load its draft model first: without
    a gate always (the paper's progressive recovery); with one, only when some target the gate would
    pair now gains enough over the assist window to make up for the full model's later start
    (`speculation.load_pays`)."""
    gate = params.gate
    if gate is None:
        return True
    targets = draft_targets(view, params, exclude)
    return any(load_pays(gate, view_gain(gate, view.workers[wid])[1]) for _, wid in targets)


def pair_drafters(
    view: ClusterView,
    drafters: Collection[WorkerId],
    current: Mapping[WorkerId, WorkerId],
    params: PairingParams,
) -> dict[WorkerId, WorkerId]:
    """The drafter → target pairing to apply now (see the module docstring for the rules)."""
    ready = sorted(
        d for d in set(drafters) if d in view.workers and view.workers[d].state is WorkerState.DRAFT_READY
    )
    targets = draft_targets(view, params, exclude=ready)
    # a current pair is kept while its target stays within `hysteresis` below the mean: two survivors
    # sharing the load evenly would otherwise swap places above the mean every few heartbeats
    healthy = {
        w.id: estimated_load(w, params.load) for w in view.workers.values() if w.state in SERVING_STATES
    }
    mean = math.fsum(healthy.values()) / len(healthy) if healthy else 0.0
    load = {
        wid: value
        for wid, value in healthy.items()
        if wid not in ready and value > 0 and value >= mean - params.hysteresis
    }
    if params.gate is not None:  # kept while drafting still speeds the target up, queue or not
        keep = replace(params.gate, min_waiting=0)
        load = {wid: value for wid, value in load.items() if assist_pays(keep, view.workers[wid])}
    cap = params.max_drafters_per_target
    pairs: dict[WorkerId, WorkerId] = {}
    count: Counter[WorkerId] = Counter()
    for d in ready:  # id order decides which current pairs survive a smaller max_drafters_per_target
        t = current.get(d)
        if t is not None and t in load and count[t] < cap:
            pairs[d] = t
            count[t] += 1

    def most_loaded_with_room(other_than: WorkerId | None = None) -> WorkerId | None:
        for _, wid in targets:
            if wid != other_than and count[wid] < cap:
                return wid
        return None

    for d in ready:
        if d in pairs:
            continue
        t = most_loaded_with_room()
        if t is None:
            break
        pairs[d] = t
        count[t] += 1

    moved = True
    while moved:  # each move raises the summed load of the served targets, so this ends
        moved = False
        for d in sorted(pairs, key=lambda d: (load[pairs[d]], d)):
            t = pairs[d]
            better = most_loaded_with_room(other_than=t)
            if better is not None and load[better] > load[t] + params.hysteresis:
                count[t] -= 1
                count[better] += 1
                pairs[d] = better
                moved = True
                break
    return pairs
