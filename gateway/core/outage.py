"""Survivors' admission during an outage (issue 17): queue order and batch limit.

While a failed worker reloads, its load is on the survivors; their queues hold both the requests
resumed from the failed worker (whose clients are mid-stream, frozen) and new arrivals.

- `resumed_first`: a resumed request goes to the front of its new worker's queue (it has already
  waited once and its client sees a stalled stream); new arrivals keep FIFO order among themselves.
- `batch_boost`: while a failure's outage or the backlog it left lasts, every serving worker admits a
  larger batch (KV permitting): decode is weight-streaming bound, so a larger batch raises throughput
  at a small cost in time per token, and drains the backlog sooner. The factor keeps the cluster's
  batch slots: workers / (workers - down), `down` the most workers out at once during this recovery,
  at most `batch_boost` (a cap; 1 is off). Only the modes whose `RecoveryPolicy.outage_admission` is
  on use it (Lumen's, not the baselines).
- `boost_min_gain`: the boost only where the cost model says it pays for the load's shape
  (`BoostGate`, `boost_gain`): a larger batch completes requests faster only while decode slots
  bound the rate; when prefill does (long prompts, short outputs: code-like loads) the boosted batch
  completes requests no faster, and its longer steps carry the prefill chunks, so the queue's
  prompts start later. The gate judges the load's shape as completed requests show it
  (`loadshape.LoadShape`) when a recovery begins and whenever more workers are out than before
  during it, the moments both shells set the factor. 0 boosts on every shape.
- `shortest_first`: while a failure's outage or backlog lasts, a survivor's queue is ordered by the
  tokens each request has to prefill, fewest first (after the resumed ones): when prefill is the
  bottleneck (long prompts, short outputs) this lowers the mean TTFT, at the tail's expense. With
  `shortest_first_rate` R > 0 (prompt tokens per second of waiting) the order ages: a request ranks by
  its arrival + prefill / R (a virtual arrival), so a long prompt yields only to requests that arrive
  within prefill / R seconds after it, which bounds how long it can starve; 0 is pure shortest first.

All are pure and shared by the simulator and the live gateway: Lumen's engine takes the queue order
(`worker_hooks/engine/scheduler.py`), and the live gateway's `OutageAdmission`
(gateway/server/recovery/outage.py) sends the boost to Lumen's workers as a lease (`SetAdmission`,
renewed while the recovery lasts, so a gateway that dies leaves no worker boosted). An SGLang server's
batch limit is a launch argument that 0.5.23 cannot change at run time: SGLang workers are not boosted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from gateway.core.costmodel import CostModel
from gateway.core.speculation import DEFAULT_CHUNK, AssistGate, request_time
from gateway.core.types import check

# how long a worker keeps a boosted batch limit unless the gateway renews it (the live gateway renews
# every third of it while the recovery lasts)
BOOST_LEASE_S = 3.0


@dataclass(frozen=True, slots=True)
class OutageParams:
    resumed_first: bool = True
    batch_boost: float = 1.5  # the cap of the survivors' batch-limit factor (1: no boost)
    shortest_first: bool = True
    shortest_first_rate: float = 2000.0  # prompt tokens one second of waiting outweighs (0: no aging)
    # the boost only where it makes a worker complete requests at least this many times faster for
    # the load's shape (`boost_gain`; 0: on every shape). The cost model gives ~1.12 for the
    # conversation trace's shape and long outputs, ~1.01 for code-like loads (docs/design.md)
    boost_min_gain: float = 1.05

    def __post_init__(self) -> None:
        ok = self.batch_boost >= 1 and math.isfinite(self.batch_boost)
        check(ok, "batch_boost", self.batch_boost, "must be a finite number >= 1")
        g = self.boost_min_gain
        check(g >= 0 and math.isfinite(g), "boost_min_gain", g, "must be a finite number >= 0")
        r = self.shortest_first_rate
        check(r >= 0 and math.isfinite(r), "shortest_first_rate", r, "must be a finite number >= 0")


class OutageSection(Protocol):
    """The outage levers' keys of a [recovery] section (the gateway's config and a scenario's alike)."""

    @property
    def resumed_first(self) -> bool: ...
    @property
    def outage_batch_boost(self) -> float: ...
    @property
    def outage_shortest_first(self) -> bool: ...
    @property
    def outage_shortest_first_rate(self) -> float: ...
    @property
    def outage_boost_min_gain(self) -> float: ...


# OutageParams' fields by the key a [recovery] section gives them (for errors that name the key)
OUTAGE_KEYS = {
    "batch_boost": "recovery.outage_batch_boost",
    "shortest_first_rate": "recovery.outage_shortest_first_rate",
    "boost_min_gain": "recovery.outage_boost_min_gain",
}


def outage_params(r: OutageSection) -> OutageParams:
    """The outage levers a [recovery] section sets (raises `ParamError` naming the field)."""
    return OutageParams(
        r.resumed_first,
        r.outage_batch_boost,
        r.outage_shortest_first,
        r.outage_shortest_first_rate,
        r.outage_boost_min_gain,
    )


@dataclass(frozen=True, slots=True)
class BoostGate:
    """The cost model of the batch boost on one worker (a worker like every other of the cluster):
    its `target` cost model, its batch limit outside a recovery (`base_batch`), the KV tokens it
    holds (`kv_tokens`: a boosted batch is only as large as its KV admits) and its prefill chunk."""

    target: CostModel
    base_batch: int
    kv_tokens: float = math.inf
    chunk: int = DEFAULT_CHUNK

    def __post_init__(self) -> None:
        check(self.base_batch >= 1, "base_batch", self.base_batch, "must be >= 1")
        check(self.kv_tokens > 0, "kv_tokens", self.kv_tokens, "must be > 0")
        check(self.chunk >= 1, "chunk", self.chunk, "must be >= 1")


def boost_gain(gate: BoostGate, factor: float, prompt_tokens: float, output_tokens: float) -> float:
    """How many times faster a worker completes requests of the load's shape (mean `prompt_tokens`
    and `output_tokens`) with its batch limit boosted by `factor` than without: the steady state of
    an overloaded worker (`speculation.request_time` without drafts: each freed slot taken at once by
    a queued request whose prompt is prefilled inside the same steps), both batches capped by what
    its KV holds at the load's mean context P + O/2. 1: the boost changes nothing (KV-bound, or a
    factor that adds no slot). Decode-bound loads gain about the batch's growth less the longer
    steps; prefill-bound ones next to nothing."""
    ctx = max(1.0, prompt_tokens + output_tokens / 2.0)
    base = admission_limit(gate.base_batch, 1.0)
    boosted = admission_limit(gate.base_batch, factor)
    if math.isfinite(gate.kv_tokens):
        fits = max(1, int(gate.kv_tokens // ctx))
        base, boosted = min(base, fits), min(boosted, fits)
    if boosted <= base:
        return 1.0
    model = AssistGate(gate.target, prompt_tokens=prompt_tokens, output_tokens=output_tokens, chunk=gate.chunk)
    return request_time(model, base, ctx, 0) / request_time(model, boosted, ctx, 0)


@dataclass(frozen=True, slots=True)
class BoostJudged:
    """One judgement of the outage boost: the factor the lost slots call for, the cost model's gain
    for the load's shape at that factor (None: not judged), and the factor granted."""

    factor: float
    gain: float | None
    granted: float


def judge_boost(
    params: OutageParams,
    recovering: bool,
    workers: int,
    down: int,
    gate: BoostGate | None = None,
    shape: tuple[float, float] | None = None,
) -> BoostJudged:
    """The serving workers' batch-limit factor: while the cluster recovers from a failure (its outage,
    then until the backlog it left has drained), what keeps the cluster's batch slots with `down` of
    its `workers` out (the most at once during this recovery), at most `batch_boost`; else 1. With a
    `gate` and the load's `shape` (mean prompt and output tokens), 1 too where that factor would not
    make a worker complete requests `boost_min_gain` times faster (`boost_gain`)."""
    if not recovering or down <= 0 or params.batch_boost <= 1:
        return BoostJudged(1.0, None, 1.0)
    factor = min(params.batch_boost, workers / max(1, workers - down))
    if gate is None or shape is None:
        return BoostJudged(factor, None, factor)
    gain = boost_gain(gate, factor, shape[0], shape[1])
    pays = params.boost_min_gain <= 0 or gain >= params.boost_min_gain
    return BoostJudged(factor, gain, factor if pays else 1.0)


def outage_boost(
    params: OutageParams,
    recovering: bool,
    workers: int,
    down: int,
    gate: BoostGate | None = None,
    shape: tuple[float, float] | None = None,
) -> float:
    """The factor granted (`judge_boost`)."""
    return judge_boost(params, recovering, workers, down, gate, shape).granted


def admission_limit(base: int, boost: float) -> int:
    """A worker's batch limit under the factor `boost` (`outage_boost`): `base × boost` rounded down,
    never below `base`."""
    return base if boost <= 1 else max(base, math.floor(base * boost))


def backlog_drained(waiting: int, serving_workers: int, all_serving: bool) -> bool:
    """Whether a recovery is over: every worker serves again and at most one request per serving
    worker is queued (the noise of normal operation, not a backlog)."""
    return all_serving and waiting <= serving_workers


def queue_first(attempt: int, params: OutageParams) -> bool:
    """Whether a request's attempt goes to the front of its worker's queue: a resumed request (the
    gateway numbers attempts from 1) when `resumed_first` is on. Both shells ask this."""
    return params.resumed_first and attempt > 1


def queue_rank(
    attempt: int, prefill_tokens: int, params: OutageParams, recovering: bool, arrival: float = 0.0
) -> tuple[int, float]:
    """Where a request stands in its worker's queue: lower first, FIFO among equal ranks. Resumed
    attempts first (`queue_first`); with `shortest_first`, while the cluster recovers, fewer tokens
    to prefill first (prompt lengths are known on arrival: no oracle), aged by `shortest_first_rate`
    (arrival + prefill / rate: `arrival` in seconds on the shell's clock). (1, 0) is plain FIFO."""
    first = 0 if queue_first(attempt, params) else 1
    if not (recovering and params.shortest_first):
        return (first, 0)
    rate = params.shortest_first_rate
    return (first, prefill_tokens if rate <= 0 else arrival + prefill_tokens / rate)


# how far ahead of every other request a resumed attempt's priority puts it: more than any virtual
# arrival a shell's clock reaches (milliseconds: 2**50 ms is ~35,700 years)
_RESUMED_AHEAD_MS = 1 << 50


def queue_priority(
    attempt: int, prefill_tokens: int, params: OutageParams, recovering: bool, arrival: float
) -> int:
    """`queue_rank` as one integer, lower first, for a server that orders its queue by a request's
    priority and then by when it queued (SGLang's `--enable-priority-scheduling
    --schedule-low-priority-values-first`): milliseconds of virtual arrival (`arrival` itself outside
    a recovery, so the order is FIFO; arrival + prefill / rate within one), minus `_RESUMED_AHEAD_MS`
    for a resumed attempt. Unaged shortest-first (rate 0) ranks by prefill tokens, which, compared
    with the milliseconds of requests queued before the recovery began, puts those last."""
    first, value = queue_rank(attempt, prefill_tokens, params, recovering, arrival)
    if not (recovering and params.shortest_first):
        value = arrival
    return round(value * 1000.0) - (_RESUMED_AHEAD_MS if first == 0 else 0)
