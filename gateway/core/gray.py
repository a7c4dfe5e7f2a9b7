"""Gray failures: a worker that keeps heartbeating but serves far slower than its peers (DESIGN 10).

A degraded GPU (thermal throttling, a failing HBM stack, a flapping NVLink) or a slow network path
does not break any stream, so failure detection never fires, yet every request on that worker runs
several times slower. The shells measure each worker's time per output token on the streams they
see; `gray_verdicts` compares each worker with the median of its peers:

- a HEALTHY worker is DEGRADED when its time per token exceeds `slow_factor` × the median of the
  other measured, non-degraded workers (at least `min_peers` of them);
- a DEGRADED worker is HEALTHY again once it is below `recover_factor` × that median (hysteresis:
  `recover_factor` < `slow_factor`, so a worker near the bound does not flap);
- at most a minority of the measured workers is degraded at once: when more look slow, the
  reference itself is in doubt (a cluster-wide slowdown, a skewed batch mix) and only the slowest
  ones, up to the minority, are degraded.

A DEGRADED worker gets no new requests and no new checkpoints; the shells move its running requests
elsewhere through recovery dispatch (restore on their holders, or replay), as after a failure.
Verdicts depend only on the ratios of the times, not on their scale or on the order of the input.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from gateway.core.health import WorkerState
from gateway.core.types import WorkerId, check


@dataclass(frozen=True, slots=True)
class GrayParams:
    enabled: bool = True
    slow_factor: float = 2.5
    recover_factor: float = 1.5
    min_peers: int = 2

    def __post_init__(self) -> None:
        check(self.slow_factor > 1, "slow_factor", self.slow_factor, "must be > 1")
        ok = 1.0 < self.recover_factor < self.slow_factor
        check(ok, "recover_factor", self.recover_factor, "must be > 1 and < slow_factor")
        check(self.min_peers >= 1, "min_peers", self.min_peers, "must be >= 1")


@dataclass(frozen=True, slots=True)
class GrayVerdict:
    degrade: frozenset[WorkerId]  # HEALTHY workers to mark DEGRADED
    restore: frozenset[WorkerId]  # DEGRADED workers to mark HEALTHY again


NO_CHANGE = GrayVerdict(frozenset(), frozenset())


@dataclass(frozen=True, slots=True)
class Observation:
    """What a shell knows of one worker's speed: its state, its measured time per token and when
    it was last measured (None: never, or not since it was trusted again), and when it was degraded."""

    worker: WorkerId
    state: WorkerState
    per_token_s: float
    measured_at: float | None
    degraded_at: float | None = None


def verdict_inputs(
    now: float, observations: list[Observation], window_s: float, probation_s: float
) -> tuple[dict[WorkerId, float], list[WorkerId]]:
    """The `per_token_s` and `degraded` arguments of `gray_verdicts`, the same way in every shell.

    A HEALTHY worker counts with a measurement at most `window_s` old. A DEGRADED worker keeps its
    last measurement (its requests were moved, nothing measures it) until `probation_s` after it
    was degraded; then it is unmeasured, which `gray_verdicts` answers by trusting it again.
    """
    times: dict[WorkerId, float] = {}
    degraded: list[WorkerId] = []
    for o in observations:
        if o.state is WorkerState.DEGRADED:
            degraded.append(o.worker)
            since = o.degraded_at if o.degraded_at is not None else now
            if o.measured_at is not None and now - since < probation_s:
                times[o.worker] = o.per_token_s
        elif o.state is WorkerState.HEALTHY and o.measured_at is not None and now - o.measured_at <= window_s:
            times[o.worker] = o.per_token_s
    return times, degraded


def gray_verdicts(
    per_token_s: Mapping[WorkerId, float], degraded: Collection[WorkerId], params: GrayParams
) -> GrayVerdict:
    """Which workers to degrade and which to trust again.

    `per_token_s`: recent time per output token of each measured worker (HEALTHY or DEGRADED; a
    worker without a recent measurement is absent). `degraded`: the workers currently DEGRADED.
    A degraded worker without a measurement is trusted again: it gets no new requests, so once its
    moved requests are gone nothing measures it, and the shell lets its last measurement expire
    after a probation period; if it is still slow, the requests it then gets degrade it again.
    """
    times = {w: t for w, t in per_token_s.items() if t > 0 and math.isfinite(t)}
    unmeasured = frozenset(w for w in degraded if w not in times)
    if not params.enabled:
        return GrayVerdict(frozenset(), frozenset(degraded))
    if len(times) < params.min_peers + 1:
        return GrayVerdict(frozenset(), unmeasured)
    was = frozenset(w for w in degraded if w in times)
    slow: list[tuple[float, WorkerId]] = []
    restore: set[WorkerId] = set()
    for w, t in times.items():
        peers = [v for u, v in times.items() if u != w and u not in was]
        if len(peers) < params.min_peers:
            continue
        ratio = t / statistics.median(peers)
        if w in was:
            if ratio < params.recover_factor:
                restore.add(w)
            else:
                slow.append((ratio, w))
        elif ratio > params.slow_factor:
            slow.append((ratio, w))
    # a minority at most: the slowest first (ties by id), already-degraded ones count too
    limit = (len(times) - 1) // 2
    slow.sort(key=lambda x: (-x[0], x[1]))
    keep = {w for _, w in slow[:limit]}
    restore |= {w for _, w in slow[limit:] if w in was}
    return GrayVerdict(frozenset(keep - was), frozenset(restore) | unmeasured)
