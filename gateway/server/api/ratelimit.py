"""Per-key admission for the client API: at most `max_concurrent` requests in flight and a token
bucket of `rate_per_s` requests per second (`burst` deep) per key. A key is an API key's key_id, or
the client's address when the API is open (routes.py picks it).

Pure: the clock is injected and nothing here does I/O. The client routes call `admit` before a
request (a `Refused` is answered 429 with `Retry-After`) and `release` once it has ended, stream
included. A refusal consumes nothing: a request refused for concurrency takes no token, one refused
for rate takes no slot. Keys whose state is indistinguishable from a fresh key's (nothing in flight,
a full bucket) are forgotten, so memory follows the keys active lately, not every key ever seen.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

# a request refused for concurrency is told to retry after this (nothing predicts when a slot frees)
CONCURRENCY_RETRY_AFTER_S = 1.0
# the key table is swept for forgettable keys once it outgrows max(this, twice its size after a sweep)
SWEEP_MIN_KEYS = 1024


@dataclass(frozen=True, slots=True)
class Limits:
    max_concurrent: int = 0  # requests in flight per key; 0: unlimited
    rate_per_s: float = 0.0  # requests per second per key; 0: unlimited
    burst: int = 0  # the bucket's size; 0: the rate rounded up, at least 1

    def __post_init__(self) -> None:
        if self.max_concurrent < 0 or self.burst < 0 or not 0 <= self.rate_per_s < math.inf:
            raise ValueError(f"invalid per-key limits: {self}")

    @property
    def enabled(self) -> bool:
        return self.max_concurrent > 0 or self.rate_per_s > 0

    @property
    def capacity(self) -> float:
        return float(self.burst or max(1, math.ceil(self.rate_per_s)))


@dataclass(frozen=True, slots=True)
class Refused:
    reason: Literal["concurrency", "rate"]
    retry_after_s: float  # > 0: when trying again can succeed (for rate: will, barring other requests)


def retry_after(seconds: float) -> str:
    """HTTP's `Retry-After` for a wait of `seconds`: whole seconds, rounded up, at least 1."""
    return str(max(1, math.ceil(seconds - 1e-9)))


def refill(tokens: float, elapsed_s: float, rate_per_s: float, capacity: float) -> float:
    """A token bucket's tokens `elapsed_s` later (a clock that goes back adds nothing)."""
    return min(capacity, tokens + max(0.0, elapsed_s) * rate_per_s)


@dataclass(slots=True)
class _Key:
    tokens: float
    stamp: float  # when `tokens` was last brought up to date
    active: int = 0


class KeyLimiter:
    def __init__(
        self, limits: Limits, clock: Callable[[], float], *, sweep_min_keys: int = SWEEP_MIN_KEYS
    ) -> None:
        self.limits = limits
        self._clock = clock
        self._keys: dict[str, _Key] = {}
        self._sweep_min = sweep_min_keys
        self._sweep_at = sweep_min_keys

    def __len__(self) -> int:
        """Keys remembered now (for tests and metrics)."""
        return len(self._keys)

    def in_flight(self, key: str) -> int:
        k = self._keys.get(key)
        return 0 if k is None else k.active

    def admit(self, key: str) -> Refused | None:
        """Admit one request of `key` (None) or refuse it; an admitted request must be released."""
        lim, now = self.limits, self._clock()
        k = self._keys.get(key)
        if k is None:
            k = _Key(tokens=lim.capacity, stamp=now)
        if lim.max_concurrent and k.active >= lim.max_concurrent:
            return Refused("concurrency", CONCURRENCY_RETRY_AFTER_S)
        if lim.rate_per_s:
            k.tokens, k.stamp = refill(k.tokens, now - k.stamp, lim.rate_per_s, lim.capacity), now
            if k.tokens < 1.0:
                self._keys.setdefault(key, k)
                return Refused("rate", (1.0 - k.tokens) / lim.rate_per_s)
            k.tokens -= 1.0
        k.active += 1
        self._keys[key] = k
        if len(self._keys) > self._sweep_at:
            self._sweep(now)
        return None

    def release(self, key: str) -> None:
        """One admitted request of `key` has ended."""
        k = self._keys.get(key)
        if k is None or k.active == 0:
            raise ValueError(f"release without admit for key {key!r}")
        k.active -= 1
        if k.active == 0 and self._forgettable(k, self._clock()):
            del self._keys[key]

    def _forgettable(self, k: _Key, now: float) -> bool:
        lim = self.limits
        if k.active:
            return False
        return not lim.rate_per_s or refill(k.tokens, now - k.stamp, lim.rate_per_s, lim.capacity) >= (
            lim.capacity
        )

    def _sweep(self, now: float) -> None:
        for key in [key for key, k in self._keys.items() if self._forgettable(k, now)]:
            del self._keys[key]
        self._sweep_at = max(self._sweep_min, 2 * len(self._keys))
