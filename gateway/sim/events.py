"""The simulator's clock: a heap of events in a deterministic total order (time, then sequence).

Two events at the same instant run in the order they were scheduled, so a run is a pure function
of the scenario and the seed.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Any, Final, cast

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

# Whether this module runs compiled (the simulator's native build, gateway/sim/native.py). The hot
# paths then push and pop with `push_event` and `pop_event`, heapq's algorithms written out on the
# (time, sequence) keys, which compile to unboxed comparisons several times cheaper than heapq's
# comparisons of whole tuples; interpreted, heapq (in C) is the cheaper one. Sequence numbers are
# unique, so the order is total and any heap pops the same events in the same order.
COMPILED: Final = not __file__.endswith(".py")


def push_event(heap: list[Event], event: Event) -> None:
    """`heapq.heappush(heap, event)`, ordered by (time, sequence)."""
    # entries as boxed tuples (compiled, a fixed-length tuple type would be unboxed into a struct
    # at every read and boxed anew at every write)
    h = cast(list[tuple[Any, ...]], heap)
    h.append(event)
    _sift_up(h, len(h) - 1, event)


def pop_event(heap: list[Event]) -> Event:
    """`heapq.heappop(heap)`, ordered by (time, sequence) (the heap must not be empty)."""
    h = cast(list[tuple[Any, ...]], heap)  # boxed, as in push_event
    last = h.pop()
    if not h:
        return cast(Event, last)
    top = h[0]
    # heapq's: move the smaller child up until a leaf, then put `last` there and sift it up
    n = len(h)
    pos = 0
    child = 1
    while child < n:
        right = child + 1
        if right < n:
            a, b = h[child], h[right]
            ta: float = a[0]
            tb: float = b[0]
            if tb < ta or (tb == ta and b[1] < a[1]):
                child = right
        h[pos] = h[child]
        pos = child
        child = 2 * pos + 1
    _sift_up(h, pos, last)
    return cast(Event, top)


def _sift_up(h: list[tuple[Any, ...]], pos: int, event: tuple[Any, ...]) -> None:
    """Put `event` at `pos`, or above it while it precedes its parent."""
    time: float = event[0]
    seq: int = event[1]
    while pos > 0:
        up = (pos - 1) >> 1
        parent = h[up]
        first: float = parent[0]
        if time < first or (time == first and seq < parent[1]):
            h[pos] = parent
            pos = up
        else:
            break
    h[pos] = event


def precedes(time: float, seq: int, heap: list[Event]) -> bool:
    """Whether an event at (time, seq) would run before every event in the heap."""
    if not heap:
        return True
    top = cast(list[tuple[Any, ...]], heap)[0]  # boxed, as in push_event
    first: float = top[0]
    return time < first or (time == first and seq < top[1])


class EventQueue:
    """The heap and the sequence are public so the simulation's loop can use them directly: it pops
    the heap (`heapq.heappop(q.heap)`, `pop_event` compiled) and checks whether the next arrival, whose
    sequence number it takes when the previous one is handled and keeps outside the heap, precedes the
    heap's events (`precedes`; `Simulation.run`)."""

    __slots__ = ("heap", "seq")

    def __init__(self) -> None:
        self.heap: list[Event] = []
        self.seq = itertools.count()

    def push(self, time: float, kind: int, a: Any = None, b: Any = None) -> None:
        if COMPILED:
            push_event(self.heap, (time, next(self.seq), kind, a, b))
        else:
            heapq.heappush(self.heap, (time, next(self.seq), kind, a, b))

    def pop(self) -> Event:
        return pop_event(self.heap) if COMPILED else heapq.heappop(self.heap)

    def __len__(self) -> int:
        return len(self.heap)
