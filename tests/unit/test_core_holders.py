"""Holder placement (Algorithm 1 and the DéjàVu ring): pure properties and worked cases."""

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.core.health import WorkerState
from gateway.core.holders import (
    HolderParams,
    choose_holders,
    reassign_holders,
    ring_key,
    with_assignment,
)
from gateway.core.load import estimated_load
from gateway.core.types import ClusterView, LoadParams, WorkerView

S = WorkerState
MiB = 1024**2


@st.composite
def clusters(draw: st.DrawFn) -> list[WorkerView]:
    n = draw(st.integers(min_value=1, max_value=10))
    ids = draw(st.lists(st.sampled_from([f"w{i}" for i in range(16)]), min_size=n, max_size=n, unique=True))
    out = []
    for i in ids:
        budget = draw(st.sampled_from([0, 10 * MiB, 100 * MiB]))
        out.append(
            WorkerView(
                id=i,
                state=draw(st.sampled_from([S.HEALTHY, S.HEALTHY, S.SUSPECT, S.FAILED, S.DRAFT_READY])),
                incarnation=1,
                running=draw(st.integers(0, 40)),
                waiting=draw(st.integers(0, 40)),
                kv_capacity_tokens=10_000,
                ckpt_tokens=draw(st.integers(0, 10_000)),
                ckpt_bytes=draw(st.integers(0, budget)),
                ckpt_budget_bytes=budget,
                failure_domain=draw(st.sampled_from(["", "r0", "r1", "r2"])),
            )
        )
    return out


holder_params = st.builds(
    HolderParams,
    load=st.builds(LoadParams, alpha=st.floats(0, 4), beta=st.floats(0, 4), nominal_batch=st.integers(1, 64)),
    replicas=st.sampled_from([1, 2]),
    exclude_failure_domain=st.booleans(),
    placement=st.sampled_from(["load_aware", "ring"]),
)
need = st.integers(0, 20 * MiB)


def healthy(i: str, **kw: object) -> WorkerView:
    base: dict[str, object] = {"kv_capacity_tokens": 1000, "ckpt_budget_bytes": 100 * MiB}
    base.update(kw)
    return WorkerView(id=i, state=S.HEALTHY, incarnation=1, **base)  # type: ignore[arg-type]


@given(clusters(), need, holder_params, st.data())
def test_holders_are_eligible(ws: list[WorkerView], nb: int, p: HolderParams, data: st.DataObject) -> None:
    serving = data.draw(st.sampled_from([w.id for w in ws]))
    view = ClusterView.of(ws)
    chosen = choose_holders(view, serving, nb, p)
    assert len(chosen) == len(set(chosen)) <= p.replicas
    for h in chosen:
        w = view.workers[h]
        assert h != serving
        assert w.state is S.HEALTHY
        assert w.ckpt_budget_bytes > 0 and w.ckpt_bytes + nb <= w.ckpt_budget_bytes
        if p.exclude_failure_domain and view.workers[serving].failure_domain:
            assert w.failure_domain != view.workers[serving].failure_domain


@given(clusters(), need, holder_params, st.data())
def test_holders_ignore_view_order(
    ws: list[WorkerView], nb: int, p: HolderParams, data: st.DataObject
) -> None:
    serving = data.draw(st.sampled_from([w.id for w in ws]))
    shuffled = data.draw(st.permutations(ws))
    assert choose_holders(ClusterView.of(ws), serving, nb, p) == choose_holders(
        ClusterView.of(shuffled), serving, nb, p
    )


@given(clusters(), need, st.data())
def test_load_aware_first_holder_is_the_eligible_minimum(
    ws: list[WorkerView], nb: int, data: st.DataObject
) -> None:
    p = HolderParams()
    serving = data.draw(st.sampled_from([w.id for w in ws]))
    eligible = [
        w
        for w in ws
        if w.id != serving
        and w.state is S.HEALTHY
        and w.ckpt_budget_bytes > 0
        and w.ckpt_bytes + nb <= w.ckpt_budget_bytes
    ]
    chosen = choose_holders(ClusterView.of(ws), serving, nb, p)
    if not eligible:
        assert chosen == ()
    else:
        assert chosen == (min((estimated_load(w, p.load), w.id) for w in eligible)[1],)


@given(st.integers(2, 9), st.integers(1, 120), st.integers(1, 4096), st.data())
def test_repeated_assignment_spreads_holders_evenly(
    n: int, requests: int, tokens: int, data: st.DataObject
) -> None:
    # one burst between heartbeats: equal loads, the shell folds each assignment into its view
    ids = [f"w{i}" for i in range(n)]
    view = ClusterView.of(healthy(i, ckpt_budget_bytes=10**12) for i in data.draw(st.permutations(ids)))
    serving = data.draw(st.sampled_from(ids))
    counts: Counter[str] = Counter()
    for _ in range(requests):
        (h,) = choose_holders(view, serving, tokens * 100, HolderParams())
        counts[h] += 1
        view = with_assignment(view, h, tokens, tokens * 100)
    per_holder = [counts[i] for i in ids if i != serving]
    assert max(per_holder) - min(per_holder) <= 1
    assert sum(per_holder) == requests


def test_budget_zero_holds_nothing_and_full_budgets_are_skipped() -> None:
    ws = [
        healthy("w0"),
        healthy("w1", ckpt_budget_bytes=0),
        healthy("w2", ckpt_bytes=95 * MiB),
        healthy("w3", running=30),
    ]
    assert choose_holders(ClusterView.of(ws), "w0", 0, HolderParams()) == ("w2",)
    assert choose_holders(ClusterView.of(ws), "w0", 10 * MiB, HolderParams()) == ("w3",)
    assert choose_holders(ClusterView.of(ws), "w0", 101 * MiB, HolderParams()) == ()


def test_two_replicas_prefer_different_domains() -> None:
    ws = [
        healthy("w0", failure_domain="a"),
        healthy("w1", failure_domain="b"),
        healthy("w2", failure_domain="b", running=1),
        healthy("w3", failure_domain="c", running=5),
    ]
    view = ClusterView.of(ws)
    # w1 is least loaded; w2 is next but shares w1's domain, so w3 is taken
    assert choose_holders(view, "w0", 0, HolderParams(replicas=2)) == ("w1", "w3")
    # without another domain available the second holder shares one
    only_b = ClusterView.of(ws[:3])
    assert choose_holders(only_b, "w0", 0, HolderParams(replicas=2)) == ("w1", "w2")


def test_failure_domain_exclusion() -> None:
    ws = [
        healthy("w0", failure_domain="a"),
        healthy("w1", failure_domain="a"),
        healthy("w2", failure_domain="b", running=20),
    ]
    view = ClusterView.of(ws)
    assert choose_holders(view, "w0", 0, HolderParams()) == ("w1",)
    assert choose_holders(view, "w0", 0, HolderParams(exclude_failure_domain=True)) == ("w2",)
    assert choose_holders(view, "w2", 0, HolderParams(exclude_failure_domain=True)) == ("w0",)
    # undeclared domains ("") exclude nothing
    plain = ClusterView.of(healthy(f"w{i}") for i in range(2))
    assert choose_holders(plain, "w0", 0, HolderParams(exclude_failure_domain=True)) == ("w1",)


def test_ring_placement_is_the_next_healthy_worker_by_id() -> None:
    ws = [healthy(f"w{i}", running=0 if i == 5 else 50) for i in range(12)]
    ws[3] = WorkerView(id="w3", state=S.SUSPECT, incarnation=1, ckpt_budget_bytes=MiB)
    view = ClusterView.of(ws)
    ring = HolderParams(placement="ring")
    assert choose_holders(view, "w1", 0, ring) == ("w2",)
    assert choose_holders(view, "w2", 0, ring) == ("w4",)  # w3 is not HEALTHY
    assert choose_holders(view, "w9", 0, ring) == ("w10",)  # natural order, not "w9" < "w90"
    assert choose_holders(view, "w11", 0, ring) == ("w0",)  # wraps around
    assert choose_holders(view, "w11", 0, HolderParams(placement="ring", replicas=2)) == ("w0", "w1")
    # load-aware picks the idle w5 instead
    assert choose_holders(view, "w1", 0, HolderParams()) == ("w5",)


def test_ring_key_is_natural_and_total() -> None:
    ids = ["w10", "w2", "w1", "a", "w01", "w", "b3c"]
    assert sorted(ids, key=ring_key) == ["a", "b3c", "w", "w01", "w1", "w2", "w10"]
    assert len({ring_key(i) for i in ids}) == len(ids)


def test_reassign_tops_up_to_replicas_away_from_live_holders() -> None:
    ws = [
        healthy("w0", failure_domain="a"),
        healthy("w1", failure_domain="b"),
        healthy("w2", failure_domain="b"),
        healthy("w3", failure_domain="c", running=3),
        WorkerView(id="w4", state=S.FAILED, incarnation=1, ckpt_budget_bytes=MiB),
    ]
    view = ClusterView.of(ws)
    two = HolderParams(replicas=2)
    # w4 (a holder) died; w1 still holds: add one, avoiding w1's domain
    assert reassign_holders(view, "w0", ("w1",), 0, two) == ("w3",)
    assert reassign_holders(view, "w0", ("w1", "w3"), 0, two) == ()
    assert reassign_holders(view, "w0", (), 0, HolderParams()) == ("w1",)
    assert reassign_holders(view, "w0", ("w1",), 0, HolderParams()) == ()


def test_with_assignment_accounts_and_refuses_negative_totals() -> None:
    view = ClusterView.of([healthy("w0"), healthy("w1")])
    after = with_assignment(view, "w1", 100, 5000)
    assert after.workers["w1"].ckpt_tokens == 100 and after.workers["w1"].ckpt_bytes == 5000
    assert view.workers["w1"].ckpt_tokens == 0  # the input view is untouched
    assert with_assignment(after, "w1", -100, -5000).workers["w1"] == view.workers["w1"]
    with pytest.raises(ValueError, match="< 0"):
        with_assignment(view, "w1", -1, 0)
    with pytest.raises(ValueError, match="not in the view"):
        with_assignment(view, "w9", 1, 1)


def test_bad_parameters_raise() -> None:
    with pytest.raises(ValueError, match="replicas"):
        HolderParams(replicas=3)
    with pytest.raises(ValueError, match="placement"):
        HolderParams(placement="random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="need_bytes"):
        choose_holders(ClusterView(), "w0", -1, HolderParams())
