"""The engine's batch limit while the cluster recovers: leases of a larger batch from the gateways.

A gateway that sees a failure's outage (gateway/core/outage.py) asks every serving Lumen worker to
admit `floor(base x boost)` requests at once, as a lease it renews while the recovery lasts
(`SetAdmission`). Leases rather than on/off messages: a gateway that dies, or whose stream breaks,
leaves no worker boosted for longer than its lease. With several gateways the largest live grant
wins; a grant of 1 withdraws that gateway's at once.
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
        self._grants: dict[str, tuple[float, float]] = {}  # source -> (boost, expires at)

    def grant(self, source: str, boost: float, lease_s: float) -> int:
        """Record `source`'s grant (boost <= 1 or a lease <= 0 withdraws it); the limit it leaves."""
        if not (math.isfinite(boost) and math.isfinite(lease_s)) or boost <= 1 or lease_s <= 0:
            self._grants.pop(source, None)
        else:
            self._grants[source] = (min(boost, MAX_BOOST), self.clock() + min(lease_s, MAX_LEASE_S))
        return self.limit()

    def clear(self) -> None:
        self._grants.clear()

    def limit(self) -> int:
        """`base`, or `floor(base x the largest live grant)`; expired grants are dropped."""
        if not self._grants:
            return self.base
        now = self.clock()
        for src in [s for s, (_, until) in self._grants.items() if until <= now]:
            del self._grants[src]
        return admission_limit(self.base, max((b for b, _ in self._grants.values()), default=1.0))

    def next_expiry(self) -> float | None:
        """When the earliest live grant ends (clock time), or None."""
        return min((until for _, until in self._grants.values()), default=None)
