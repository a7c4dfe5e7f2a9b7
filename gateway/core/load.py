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
from typing import Final

from gateway.core.health import SERVING_STATES
from gateway.core.types import ClusterView, LoadParams, WorkerId, WorkerView

# SERVING_STATES as a tuple: `state in SERVING` is the same test, by identity (states are enum
# members), without hashing the enum
SERVING: Final = tuple(SERVING_STATES)
# a derived table is updated in place for at most this many changed workers, else rebuilt
_MAX_INCREMENTAL = 16
# Whether this module runs compiled (the simulator's native build, gateway/sim/native.py). `update`
# then places workers by `_index`, a binary search that compiles to unboxed float and str
# comparisons, several times cheaper there than `bisect` on tuples; interpreted, `bisect` (in C) is
# the cheaper one. Both give the same places (tests/unit/test_core_view_update.py runs both).
COMPILED: Final = not __file__.endswith(".py")


def checkpoint_term(w: WorkerView) -> float:
    """Checkpointed KV tokens w holds, as a fraction of its KV capacity (what it absorbs on restore)."""
    return w.ckpt_tokens / max(1, w.kv_capacity_tokens)


def queue_term(w: WorkerView, nominal_batch: int) -> float:
    """Requests running, waiting, and routed-but-unreported, over the nominal batch size."""
    return (w.running + w.waiting + w.pending) / max(1, nominal_batch)


def estimated_load(w: WorkerView, params: LoadParams) -> float:
    memo = w.load_memo  # the last two (params, L̂) computed for w, by identity of the params
    if memo is not None:
        if memo[0] is params:
            return memo[1]
        if memo[2] is params:
            return memo[3]
    # checkpoint_term and queue_term inlined (the same operations, so the same float)
    load = params.alpha * (w.ckpt_tokens / max(1, w.kv_capacity_tokens)) + params.beta * (
        (w.running + w.waiting + w.pending) / max(1, params.nominal_batch)
    )
    # a memo on a frozen value (see WorkerView)
    object.__setattr__(
        w, "load_memo", (params, load, None, 0.0) if memo is None else (params, load, memo[0], memo[1])
    )
    return load


class LoadTable:
    """The serving workers of one view by `(L̂, id)`, lowest first (and, on demand, `L̂` by id).

    Immutable once built (a view's table is shared by every decision on that view), but by `update`,
    which only the sole owner of a view may use (`ClusterView.update_in_place`).
    """

    __slots__ = ("_loads", "_total", "params", "ranked")

    def __init__(self, params: LoadParams, ranked: list[tuple[float, WorkerId]]) -> None:
        self.params = params
        self.ranked = ranked
        self._loads: dict[WorkerId, float] | None = None
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
        return LoadTable(params, ranked)

    @property
    def loads(self) -> dict[WorkerId, float]:
        """`L̂` of every serving worker, by id."""
        if self._loads is None:
            self._loads = {wid: load for load, wid in self.ranked}
        return self._loads

    def total(self) -> float:
        """`math.fsum` of every serving worker's `L̂` (exactly rounded: independent of order)."""
        if self._total is None:
            self._total = math.fsum(load for load, _ in self.ranked)
        return self._total

    def derive(self, changes: list[tuple[WorkerView | None, WorkerView]]) -> LoadTable | None:
        try:
            ranked = self._moved(changes, None, None)
        except _Rebuild:
            return None
        # a table is never changed once made (but by `update`), so an unchanged one is shared
        return self if ranked is None else LoadTable(self.params, ranked)

    def update(self, changes: list[tuple[WorkerView | None, WorkerView]]) -> bool:
        """`derive`, in this table itself (`ClusterView.update_in_place`: for a view's sole owner).

        The table's `loads` are kept up to date as well (made at the first update): each worker's
        old `L̂` is read there, never from its old version (`was` is not read: a sole owner may pass
        an entry it changed in place as both). `_moved` with this table's own books, in a loop of
        its own (the simulator's hot path): the same floats and the same moves."""
        if len(changes) > _MAX_INCREMENTAL:
            return False  # the caller drops this table: rebuilt on first use
        params = self.params
        batch = params.nominal_batch
        alpha, beta, batch = params.alpha, params.beta, batch if batch > 1 else 1  # max(1, batch)
        loads = self._loads
        if loads is None:
            loads = self.loads
        ranked, serving, by_hand = self.ranked, SERVING, COMPILED
        for _, w in changes:
            wid = w.id
            old = loads.get(wid)
            if w.state in serving:
                cap = w.kv_capacity_tokens  # estimated_load inlined, as in _moved
                new = alpha * (w.ckpt_tokens / (cap if cap > 1 else 1)) + beta * (
                    (w.running + w.waiting + w.pending) / batch
                )
                if old is not None and new == old and (new or _same_zero(new, old)):
                    continue  # same rank
                n = len(ranked)
                if old is None:
                    lo, hi = 0, n
                else:
                    i = _index(ranked, old, wid, 0, n) if by_hand else bisect_left(ranked, (old, wid))
                    if i == n or ranked[i][1] != wid:
                        return False  # not where it should be (a non-finite L̂): rebuild
                    del ranked[i]
                    # the keys are unique: its new place is on the side of i it moves to
                    lo, hi = (i, n - 1) if new > old else (0, i)
                if by_hand:
                    ranked.insert(_index(ranked, new, wid, lo, hi), (new, wid))
                else:
                    insort(ranked, (new, wid), lo, hi)
                loads[wid] = new
            elif old is not None:  # no longer serving
                n = len(ranked)
                i = _index(ranked, old, wid, 0, n) if by_hand else bisect_left(ranked, (old, wid))
                if i == n or ranked[i][1] != wid:
                    return False
                del ranked[i]
                del loads[wid]
        self._total = None
        return True

    def _moved(
        self,
        changes: list[tuple[WorkerView | None, WorkerView]],
        ranked: list[tuple[float, WorkerId]] | None,
        loads: dict[WorkerId, float] | None,
    ) -> list[tuple[float, WorkerId]] | None:
        """The ranking after `changes`, moved in `ranked` (None: in a copy of this table's, made at the
        first change that moves a worker), and in `loads` if given (`L̂` by id, matching `ranked`:
        each old `L̂` is read there). Returns the list changed (None: no worker moved and no list
        given); raises `_Rebuild` when the changes cannot be applied incrementally."""
        if len(changes) > _MAX_INCREMENTAL:
            raise _Rebuild
        params = self.params
        alpha, beta, batch = params.alpha, params.beta, max(1, params.nominal_batch)
        for was, w in changes:
            # L̂ before and after (None: not serving): estimated_load inlined, the same operations
            # and so the same floats; the table holds `was` at its L̂, as `was` is in the old view
            wid = w.id
            old: float | None = None
            if loads is not None:
                old = loads.get(wid)
            elif was is not None and was.state in SERVING:
                cap = was.kv_capacity_tokens  # max(1, cap) without the call (an int: same value)
                old = alpha * (was.ckpt_tokens / (cap if cap > 1 else 1)) + beta * (
                    (was.running + was.waiting + was.pending) / batch
                )
            new: float | None = None
            if w.state in SERVING:
                cap = w.kv_capacity_tokens
                new = alpha * (w.ckpt_tokens / (cap if cap > 1 else 1)) + beta * (
                    (w.running + w.waiting + w.pending) / batch
                )
            if new == old and (new or _same_zero(new, old)):
                continue  # same rank (None == None: neither serving)
            if ranked is None:
                ranked = self.ranked.copy()
            if old is not None:
                i = bisect_left(ranked, (old, wid))
                if i == len(ranked) or ranked[i][1] != wid:
                    raise _Rebuild  # not where it should be (a non-finite L̂): rebuild
                del ranked[i]
            if new is not None:
                insort(ranked, (new, wid))
            if loads is not None:
                if new is None:
                    del loads[wid]
                else:
                    loads[wid] = new
        return ranked


def _index(ranked: list[tuple[float, WorkerId]], load: float, wid: WorkerId, lo: int, hi: int) -> int:
    """`bisect_left(ranked, (load, wid), lo, hi)`, written out (see COMPILED): `(l, i) < (load, wid)`
    exactly as tuples compare, the first items by `==` then `<`, the ids only when those are equal."""
    while lo < hi:
        mid = (lo + hi) >> 1
        entry = ranked[mid]
        first = entry[0]
        if first < load or (first == load and entry[1] < wid):
            lo = mid + 1
        else:
            hi = mid
    return lo


class _Rebuild(Exception):
    """A table cannot follow the changes incrementally: it is rebuilt from the view on first use."""


def _same_zero(a: float | None, b: float | None) -> bool:
    """Equal zeros of one sign (0.0 == -0.0, but a decision prints them differently), or both None."""
    if a is None or b is None:
        return a is b
    return math.copysign(1.0, a) == math.copysign(1.0, b)


def load_table(view: ClusterView, params: LoadParams) -> LoadTable:
    """`view`'s serving workers ranked by `(L̂, id)` under `params` (built once per view).

    Kept in `view.derived` under `id(params)`: an int hashes faster than the dataclass, and the table
    holds `params`, so that id cannot be reused by another object while the table exists.
    """
    key = id(params)
    table = view.derived.get(key)
    # (an isinstance test, not a cast: a cast's `LoadTable | None` is a new union at every call)
    if not isinstance(table, LoadTable) or table.params is not params:
        table = LoadTable.build(view, params)
        view.derived[key] = table
    return table
