"""The estimated recovery load `L̂(w) = α·ckpt(w) + β·queue(w)` (DESIGN 6).

Routing, holder placement and dispatch all rank the serving workers of a view by `(L̂, id)`. A view
keeps that ranking (`LoadTable`, one per LoadParams) once computed, and `ClusterView.with_workers`
updates it for the workers that changed, so a decision on a view that differs from the previous one
in a few workers does not recompute 64 loads. `L̂` of each WorkerView is memoised on it as well.
`L̂` is assumed finite (finite α and β): the ranking is a sort by it.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from typing import Final, cast

from gateway.core.health import SERVING_STATES
from gateway.core.types import ClusterView, LoadParams, WorkerId, WorkerView

# SERVING_STATES as a tuple: `state in SERVING` is the same test, by identity (states are enum
# members), without hashing the enum
SERVING: Final = tuple(SERVING_STATES)
# a derived table is updated in place for at most this many changed workers, else rebuilt
_MAX_INCREMENTAL = 16


def checkpoint_term(w: WorkerView) -> float:
    """Checkpointed KV tokens w holds, as a fraction of its KV capacity (what it absorbs on restore)."""
    return w.ckpt_tokens / max(1, w.kv_capacity_tokens)


def queue_term(w: WorkerView, nominal_batch: int) -> float:
    """Requests running, waiting, and routed-but-unreported, over the nominal batch size."""
    return (w.running + w.waiting + w.pending) / max(1, nominal_batch)


def estimated_load(w: WorkerView, params: LoadParams) -> float:
    memo = w.load_memo
    if memo is not None and (memo[0] is params or memo[0] == params):
        return memo[1]
    # checkpoint_term and queue_term inlined (the same operations, so the same float)
    load = params.alpha * (w.ckpt_tokens / max(1, w.kv_capacity_tokens)) + params.beta * (
        (w.running + w.waiting + w.pending) / max(1, params.nominal_batch)
    )
    object.__setattr__(w, "load_memo", (params, load))  # a memo on a frozen value (see WorkerView)
    return load


class LoadTable:
    """The serving workers of one view by `(L̂, id)`, lowest first, and `L̂` of each.

    Immutable once built (a view's table is shared by every decision on that view).
    """

    __slots__ = ("_total", "loads", "params", "ranked")

    def __init__(
        self, params: LoadParams, ranked: list[tuple[float, WorkerId]], loads: dict[WorkerId, float]
    ) -> None:
        self.params = params
        self.ranked = ranked
        self.loads = loads
        self._total: float | None = None

    @staticmethod
    def build(view: ClusterView, params: LoadParams) -> LoadTable:
        ranked = []
        for w in view.workers.values():
            if w.state in SERVING:
                memo = w.load_memo  # estimated_load's memo, read here to save a call per worker
                load = memo[1] if memo is not None and memo[0] is params else estimated_load(w, params)
                ranked.append((load, w.id))
        ranked.sort()
        return LoadTable(params, ranked, {wid: load for load, wid in ranked})

    def total(self) -> float:
        """`math.fsum` of every serving worker's `L̂` (exactly rounded: independent of order)."""
        if self._total is None:
            self._total = math.fsum(self.loads.values())
        return self._total

    def derive(self, changes: list[tuple[WorkerView | None, WorkerView]]) -> LoadTable | None:
        if len(changes) > _MAX_INCREMENTAL:
            return None
        params = self.params
        ranked: list[tuple[float, WorkerId]] | None = None  # copied at the first real change
        loads = self.loads
        for _, w in changes:
            wid = w.id
            old = loads.get(wid)
            new = estimated_load(w, params) if w.state in SERVING else None
            if new == old and (new or _same_zero(new, old)):
                continue  # same rank (None == None: neither serving)
            if ranked is None:
                ranked, loads = self.ranked.copy(), loads.copy()
            if old is not None:
                del loads[wid]
                i = bisect_left(ranked, (old, wid))
                if i == len(ranked) or ranked[i][1] != wid:
                    return None  # not where it should be (a non-finite L̂): rebuild
                del ranked[i]
            if new is not None:
                loads[wid] = new
                insort(ranked, (new, wid))
        # a table is never changed once made, so an unchanged one is shared
        return self if ranked is None else LoadTable(params, ranked, loads)


def _same_zero(a: float | None, b: float | None) -> bool:
    """Equal zeros of one sign (0.0 == -0.0, but a decision prints them differently), or both None."""
    if a is None or b is None:
        return a is b
    return math.copysign(1.0, a) == math.copysign(1.0, b)


def load_table(view: ClusterView, params: LoadParams) -> LoadTable:
    """`view`'s serving workers ranked by `(L̂, id)` under `params` (built once per view)."""
    table = view.derived.get(params)
    if table is None:
        table = view.derived[params] = LoadTable.build(view, params)
    return cast(LoadTable, table)
