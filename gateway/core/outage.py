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

    def __post_init__(self) -> None:
        ok = self.batch_boost >= 1 and math.isfinite(self.batch_boost)
        check(ok, "batch_boost", self.batch_boost, "must be a finite number >= 1")
        r = self.shortest_first_rate
        check(r >= 0 and math.isfinite(r), "shortest_first_rate", r, "must be a finite number >= 0")


def outage_boost(params: OutageParams, recovering: bool, workers: int, down: int) -> float:
    """The serving workers' batch-limit factor: while the cluster recovers from a failure (its outage,
    then until the backlog it left has drained), what keeps the cluster's batch slots with `down` of
    its `workers` out (the most at once during this recovery), at most `batch_boost`; else 1."""
    if not recovering or down <= 0 or params.batch_boost <= 1:
        return 1.0
    return min(params.batch_boost, workers / max(1, workers - down))


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
