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
from dataclasses import dataclass, field
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


# -- fair shares of work between keys ------------------------------------------------------------
@dataclass(slots=True, eq=False)  # each ticket is itself: two of equal work are not the same one
class WorkTicket:
    """One admitted (or waiting) unit of work: a choice's tokens to prefill and decode."""

    key: str
    work: int  # tokens of work still counted against the key and the gateway
    admitted: bool = False


@dataclass(slots=True)
class _Tenant:
    in_flight: int = 0  # work of its admitted tickets
    running: int = 0  # its admitted tickets
    waiting: list[WorkTicket] = field(default_factory=list)  # FIFO


class FairShare:
    """Work-conserving fair sharing of the gateway's capacity between keys (issue 29).

    Work is counted in tokens: a choice's prompt tokens to prefill plus its max new tokens to decode,
    released as they are done (the prompt at the first token, then each token). The gateway admits
    work while what is in flight stays within `capacity()`; beyond it, work waits in a FIFO per key,
    and as capacity frees the key with the least work in flight goes first (max-min fairness: weighted
    fair queuing with equal weights), so a key's many large requests take turns with the others'
    rather than going ahead of them. A key with nothing in flight is always admitted at once: no
    key's first token waits behind another key's work at the gateway. Pure: callers wake waiters.
    """

    def __init__(self, capacity: Callable[[], int]) -> None:
        self.capacity = capacity
        self.in_flight = 0
        self._tenants: dict[str, _Tenant] = {}

    def tenant(self, key: str) -> _Tenant:
        t = self._tenants.get(key)
        if t is None:
            t = self._tenants[key] = _Tenant()
        return t

    def request(self, key: str, work: int) -> WorkTicket:
        """A ticket for `work` tokens of `key`: admitted at once (`admitted`), or queued."""
        ticket = WorkTicket(key, max(1, work))
        t = self.tenant(key)
        if t.running == 0 or (not self._anyone_waiting() and self.in_flight + ticket.work <= self.capacity()):
            self._admit(ticket, t)
        else:
            t.waiting.append(ticket)
        return ticket

    def done(self, ticket: WorkTicket, work: int) -> list[WorkTicket]:
        """`work` tokens of an admitted ticket are done; returns the tickets admitted thereby."""
        if not ticket.admitted or work <= 0:
            return []
        work = min(work, ticket.work - 1)  # a ticket counts at least 1 until released
        ticket.work -= work
        self.tenant(ticket.key).in_flight -= work
        self.in_flight -= work
        return self._admit_waiting()

    def release(self, ticket: WorkTicket) -> list[WorkTicket]:
        """The ticket's work has ended (or it gave up waiting); returns the tickets admitted thereby."""
        t = self._tenants.get(ticket.key)
        if t is None:
            return []
        if ticket.admitted:
            t.in_flight -= ticket.work
            t.running -= 1
            self.in_flight -= ticket.work
            ticket.admitted = False
            ticket.work = 0
        elif ticket in t.waiting:
            t.waiting.remove(ticket)
        if t.running == 0 and not t.waiting:
            del self._tenants[ticket.key]
        return self._admit_waiting()

    def waiting(self) -> int:
        return sum(len(t.waiting) for t in self._tenants.values())

    def _anyone_waiting(self) -> bool:
        return any(t.waiting for t in self._tenants.values())

    def _admit(self, ticket: WorkTicket, t: _Tenant) -> None:
        ticket.admitted = True
        t.in_flight += ticket.work
        t.running += 1
        self.in_flight += ticket.work

    def _admit_waiting(self) -> list[WorkTicket]:
        admitted: list[WorkTicket] = []
        while True:
            ready = [(t.in_flight, key) for key, t in self._tenants.items() if t.waiting]
            if not ready:
                return admitted
            _, key = min(ready)  # the least served key first (ties: by key, deterministic)
            t = self._tenants[key]
            head = t.waiting[0]
            if t.running and self.in_flight + head.work > self.capacity() and self.in_flight > 0:
                return admitted
            t.waiting.pop(0)
            self._admit(head, t)
            admitted.append(head)
