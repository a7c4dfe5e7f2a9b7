"""The simulator's clock: a heap of events in a deterministic total order (time, then sequence).

Two events at the same instant run in the order they were scheduled, so a run is a pure function
of the scenario and the seed.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Final

# event kinds (Final: compiled modules use them as constants, gateway/sim/native.py)
ARRIVAL: Final = 0  # the next request of the workload arrives (not in the heap: Simulation.run)
STEP: Final = 1  # a worker's step (or run of decode steps) ends; a = worker, b = the worker's plan version
RESTORED: Final = 2  # a request's KV restore (host -> GPU) finished; a = worker, b = (request, incarnation)
KILL: Final = 3  # a failure of the scenario strikes; a = its index
DETECT: Final = 4  # the gateway detects failed workers; a = tuple of (worker, incarnation)
PHASE: Final = 5  # a restarting worker reaches a phase; a = worker, b = (incarnation, state, reload or None)
TICK: Final = 6  # periodic sampling and draft-assist re-pairing
GIVE_UP: Final = 7  # a request that found no HEALTHY worker has waited long enough; a = request
SEED: Final = 8  # a seeded reload's transfer begins: the seed slows down; a = the reload (reloads.ActiveReload)
RESTART: Final = 9  # a hung worker still FAILED is killed and restarted; a = worker, b = its hung incarnation

Event = tuple[float, int, int, Any, Any]


class EventQueue:
    """The heap and the sequence are public so the hot paths can use them directly: the simulation's
    loop pops the heap (`heapq.heappop(q.heap)`), and a worker pushes its steps as `push` does
    (`heapq.heappush(q.heap, (time, next(q.seq), kind, a, b))`). The simulation also takes a sequence
    number for each arrival, which it keeps outside the heap (`Simulation.run`)."""

    __slots__ = ("heap", "seq")

    def __init__(self) -> None:
        self.heap: list[Event] = []
        self.seq = itertools.count()

    def push(self, time: float, kind: int, a: Any = None, b: Any = None) -> None:
        heapq.heappush(self.heap, (time, next(self.seq), kind, a, b))

    def pop(self) -> Event:
        return heapq.heappop(self.heap)

    def __len__(self) -> int:
        return len(self.heap)
