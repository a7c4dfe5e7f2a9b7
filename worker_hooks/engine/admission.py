"""The engine's admission while the cluster recovers: leases from the gateways (gateway/core/outage.py).

A gateway that sees a failure's outage asks every serving Lumen worker to admit `floor(base x boost)`
requests at once, and to order its queue shortest prefill first (aged), as a lease it renews while the
recovery lasts (`SetAdmission`). Leases rather than on/off messages: a gateway that dies, or whose
stream breaks, leaves no worker changed for longer than its lease. With several gateways the largest
live boost wins, and the queue order of the most recently renewed grant; a grant with boost 1 and no
ordering withdraws that gateway's at once.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

import structlog

from gateway.core.outage import OutageParams, admission_limit, queue_rank
from worker_hooks.engine.scheduler import BatchScheduler, Seq

log = structlog.get_logger(__name__)

MAX_BOOST = 8.0  # a grant above this is a bug or a hostile message: clamped
MAX_LEASE_S = 60.0


class AdmissionLeases:
    """The batch limit under the gateways' live grants: `grant(source, boost, lease_s)`, `limit()`."""

    def __init__(self, base: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.base = base
        self.clock = clock
        # source -> (boost, expires at, shortest-first rate or None: no ordering)
        self._grants: dict[str, tuple[float, float, float | None]] = {}

    def grant(
        self, source: str, boost: float, lease_s: float, shortest_first_rate: float | None = None
    ) -> int:
        """Record `source`'s grant: a boost (<= 1: none) and a queue order (`shortest_first_rate`:
        aged shortest prefill first at that rate, 0 unaged; None: FIFO). A grant of neither, or a
        lease <= 0, withdraws `source`'s. Returns the batch limit it leaves."""
        ok = math.isfinite(boost) and math.isfinite(lease_s) and lease_s > 0
        rate = shortest_first_rate
        if rate is not None and not (math.isfinite(rate) and rate >= 0):
            rate = None
        if not ok or (boost <= 1 and rate is None):
            self._grants.pop(source, None)
        else:
            until = self.clock() + min(lease_s, MAX_LEASE_S)
            self._grants[source] = (min(max(boost, 1.0), MAX_BOOST), until, rate)
        return self.limit()

    def clear(self) -> None:
        self._grants.clear()

    def limit(self) -> int:
        """`base`, or `floor(base x the largest live grant)`; expired grants are dropped."""
        if not self._grants:
            return self.base
        self._expire()
        return admission_limit(self.base, max((g[0] for g in self._grants.values()), default=1.0))

    def shortest_first_rate(self) -> float | None:
        """The queue order of the most recently renewed live grant: its aging rate, or None (FIFO)."""
        self._expire()
        if not self._grants:
            return None
        return max(self._grants.values(), key=lambda g: g[1])[2]

    def next_expiry(self) -> float | None:
        """When the earliest live grant ends (clock time), or None."""
        return min((g[1] for g in self._grants.values()), default=None)

    def _expire(self) -> None:
        now = self.clock()
        for src in [s for s, g in self._grants.items() if g[1] <= now]:
            del self._grants[src]


def aged_shortest_first(rate: float) -> Callable[[Seq], tuple[int, float]]:
    """The queue rank of a recovery (gateway.core.outage.queue_rank): resumed first, then the fewest
    tokens to prefill, aged at `rate` tokens per second of waiting (0: not aged)."""
    params = OutageParams(shortest_first=True, shortest_first_rate=rate)

    def rank(seq: Seq) -> tuple[int, float]:
        prefill = max(1, len(seq.prompt) - seq.restored)
        return queue_rank(2 if seq.resumed else 1, prefill, params, True, seq.enqueued_at)

    return rank


class Admission:
    """The leases applied to one engine's scheduler: its batch limit and queue order follow the live
    grants, and are looked at again when the earliest of them ends (a timer on the running loop)."""

    def __init__(
        self,
        worker_id: str,
        scheduler: BatchScheduler,
        base: int,
        wake: Callable[[], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.worker_id = worker_id
        self.scheduler = scheduler
        self.leases = AdmissionLeases(base, clock)
        self.wake = wake  # the step loop: a raised limit may admit queued requests now
        self._timer: asyncio.TimerHandle | None = None
        self._rate: float | None = None  # the aged shortest-first order in force (None: FIFO)

    def grant(self, source: str, boost: float, lease_s: float, shortest_first_rate: float | None) -> int:
        self.leases.grant(source, boost, lease_s, shortest_first_rate)
        return self.apply()

    def clear(self) -> None:
        self.leases.clear()
        self.apply()

    def apply(self) -> int:
        """Set the scheduler's batch limit and queue order to what the live leases say. A lower limit
        preempts nothing: it admits less until the batch shrinks."""
        rate = self.leases.shortest_first_rate()
        if rate != self._rate:
            self._rate = rate
            self.scheduler.set_rank(None if rate is None else aged_shortest_first(rate))
            log.info("queue order", worker_id=self.worker_id, shortest_first_rate=rate)
        limit = self.leases.limit()
        old = self.scheduler.max_running
        if limit != old:
            self.scheduler.max_running = limit
            log.info("batch limit", worker_id=self.worker_id, max_running=limit, was=old)
            if limit > old:
                self.wake()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        until = self.leases.next_expiry()
        if until is not None:
            delay = max(0.0, until - self.leases.clock())
            self._timer = asyncio.get_running_loop().call_later(delay, self.apply)
        return limit
