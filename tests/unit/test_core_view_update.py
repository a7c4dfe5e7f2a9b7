"""`ClusterView.update_in_place` (the simulator's view refresh) leaves a view exactly as
`with_workers` makes a new one: the same workers and the same derived tables (the ranked load tables
and the holders' ring), whatever the changes: repeated ids, state changes, new workers, more changes
than a table follows incrementally. And a view built from scratch ranks its workers the same way.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.core import load as load_module
from gateway.core.health import WorkerState
from gateway.core.holders import HolderParams, choose_holders
from gateway.core.load import LoadTable, load_table
from gateway.core.router import choose_worker
from gateway.core.types import ClusterView, LoadParams, WorkerView

S = WorkerState
IDS = [f"w{i}" for i in range(20)]
PARAMS = (LoadParams(), LoadParams(alpha=0.0, beta=1.0, nominal_batch=4), LoadParams(2.0, 0.5, 3))


def worker(wid: str, draw: st.DrawFn) -> WorkerView:
    return WorkerView(
        id=wid,
        state=draw(st.sampled_from([S.HEALTHY, S.HEALTHY, S.HEALTHY, S.DRAFT_READY, S.FAILED])),
        incarnation=1,
        # small ranges so that equal loads (ties by id) are common
        running=draw(st.integers(0, 3)),
        waiting=draw(st.integers(0, 3)),
        pending=draw(st.integers(0, 1)),
        kv_capacity_tokens=draw(st.sampled_from([1, 1000])),
        ckpt_tokens=draw(st.sampled_from([0, 100, 500])),
        ckpt_bytes=draw(st.integers(0, 1000)),
        ckpt_budget_bytes=1000,
    )


@st.composite
def scripts(draw: st.DrawFn) -> tuple[list[WorkerView], list[list[WorkerView]]]:
    """A first view's workers, then batches of changed workers (ids may repeat within a batch)."""
    ids = draw(st.lists(st.sampled_from(IDS), min_size=1, max_size=12, unique=True))
    first = [worker(i, draw) for i in ids]
    batches = []
    for _ in range(draw(st.integers(1, 6))):
        size = draw(st.sampled_from([0, 1, 2, 3, 18]))  # 18: more than a table follows incrementally
        batches.append([worker(draw(st.sampled_from(IDS)), draw) for _ in range(size)])
    return first, batches


def tables(view: ClusterView) -> dict[object, list[tuple[float, str]] | None]:
    out: dict[object, list[tuple[float, str]] | None] = {}
    for key, table in view.derived.items():
        out[key] = table.ranked if isinstance(table, LoadTable) else None
    return out


@given(scripts(), st.data())
def test_update_in_place_equals_with_workers(
    script: tuple[list[WorkerView], list[list[WorkerView]]], data: st.DataObject
) -> None:
    first, batches = script
    functional, owned = ClusterView.of(first), ClusterView.of(first)
    # update's two ways of placing a worker (`load.COMPILED`: its own binary search, or bisect)
    by_hand = data.draw(st.booleans())
    compiled = load_module.COMPILED
    load_module.COMPILED = by_hand  # type: ignore[misc]  # (Final: for this test only)
    try:
        _follow(functional, owned, batches, data)
    finally:
        load_module.COMPILED = compiled  # type: ignore[misc]


def _follow(
    functional: ClusterView, owned: ClusterView, batches: list[list[WorkerView]], data: st.DataObject
) -> None:
    for changed in batches:
        for p in PARAMS:
            if data.draw(st.booleans()):  # the tables exist before the change (or are built after it)
                load_table(functional, p)
                load_table(owned, p)
        choose_holders(functional, "w0", 10, HolderParams(placement="ring"))  # the ring table too
        choose_holders(owned, "w0", 10, HolderParams(placement="ring"))
        functional = functional.with_workers(changed)
        owned.update_in_place(changed)
        assert owned.workers == functional.workers
        # a table carried over is the one the functional path carried (or both rebuild it on use)
        kept = tables(owned)
        for key, ranked in tables(functional).items():
            if key in kept:
                assert kept[key] == ranked
        for p in PARAMS:
            assert load_table(owned, p).ranked == load_table(functional, p).ranked
            assert load_table(owned, p).loads == load_table(functional, p).loads
            assert load_table(owned, p).total() == load_table(functional, p).total()
            assert choose_worker(owned, p) == choose_worker(functional, p)
            fresh = ClusterView(dict(owned.workers))
            assert load_table(fresh, p).ranked == load_table(owned, p).ranked
        ring = HolderParams(placement="ring")
        assert choose_holders(owned, "w3", 10, ring) == choose_holders(functional, "w3", 10, ring)


def test_update_in_place_resets_a_tables_cached_sums() -> None:
    p = LoadParams()
    view = ClusterView.of([WorkerView("a", S.HEALTHY, 1, running=1), WorkerView("b", S.HEALTHY, 1)])
    table = load_table(view, p)
    assert table.loads == {"a": 1 / 32, "b": 0.0} and table.total() == 1 / 32
    view.update_in_place([replace(view.workers["b"], running=3)])
    assert load_table(view, p) is table  # followed in place
    assert table.loads == {"a": 1 / 32, "b": 3 / 32} and table.total() == 4 / 32
    assert [wid for _, wid in table.ranked] == ["a", "b"]


def test_update_in_place_needs_a_dict() -> None:
    from types import MappingProxyType

    view = ClusterView(MappingProxyType({"a": WorkerView("a", S.HEALTHY, 1)}))
    with pytest.raises(TypeError):
        view.update_in_place([WorkerView("a", S.FAILED, 1)])
