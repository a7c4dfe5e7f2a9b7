"""The simulator's clock: a heap of events in a deterministic total order (time, then sequence).

Two events at the same instant run in the order they were scheduled, so a run is a pure function
of the scenario and the seed.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any

# event kinds
ARRIVAL = 0  # the next request of the workload arrives at the gateway
STEP = 1  # a worker's step (or run of decode steps) ends; a = worker, b = the worker's plan version
RESTORED = 2  # a request's KV restore (host -> GPU) finished; a = worker, b = (request, incarnation)
KILL = 3  # a failure of the scenario strikes; a = its index
DETECT = 4  # the gateway detects failed workers; a = tuple of (worker, incarnation)
PHASE = 5  # a restarting worker reaches a phase; a = worker, b = (incarnation, state, reload or None)
TICK = 6  # periodic sampling and draft-assist re-pairing
GIVE_UP = 7  # a request that found no HEALTHY worker has waited long enough; a = request
SEED = 8  # a seeded reload's transfer begins: the seed slows down; a = the reload (simulation._Reload)
RESTART = 9  # a hung worker still FAILED is killed and restarted; a = worker, b = its hung incarnation

Event = tuple[float, int, int, Any, Any]


class EventQueue:
    """The heap is public so the simulation's loop can pop it directly (`heapq.heappop(q.heap)`)."""

    __slots__ = ("_seq", "heap")

    def __init__(self) -> None:
        self.heap: list[Event] = []
        self._seq = itertools.count()

    def push(self, time: float, kind: int, a: Any = None, b: Any = None) -> None:
        heapq.heappush(self.heap, (time, next(self._seq), kind, a, b))

    def pop(self) -> Event:
        return heapq.heappop(self.heap)

    def __len__(self) -> int:
        return len(self.heap)
