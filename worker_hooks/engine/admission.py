"""The engine's admission while the cluster recovers: leases from the gateways (gateway/core/outage.py).

A gateway that sees a failure's outage asks every serving Lumen worker to admit `floor(base x boost)`
requests at once, and to order its queue shortest prefill first (aged), as a lease it renews while the
recovery lasts (`SetAdmission`). Leases rather than on/off messages: a gateway that dies, or whose
stream breaks, leaves no worker changed for longer than its lease. With several gateways the largest
live boost wins, and the queue order of the most recently renewed grant; a grant with boost 1 and no
ordering withdraws that gateway's at once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from gateway.core.outage import admission_limit

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
