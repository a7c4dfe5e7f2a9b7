"""The fast policy paths (ranked load tables kept with a view, early-exit scans) decide exactly as the
straightforward definitions do: a reference copy of each policy as first written (full scans and
sorts of the whole view) is compared with the real one on random views, fresh and incrementally
derived (`with_assignment`, `ClusterView.with_workers`), including views whose tables are stale
copies of an earlier one. No timing here: speed is measured by loadtests/bench_policy.py.
"""

from __future__ import annotations

import math
from dataclasses import fields, replace

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.costmodel import GPUS, MODELS, CostModel, StepWork
from gateway.core.dispatch import (
    Decision,
    DispatchParams,
    InterruptedRequest,
    dispatch,
    uniform_step_time,
)
from gateway.core.health import SERVING_STATES, WorkerState
from gateway.core.holders import HolderParams, choose_holders, reassign_holders, ring_key, with_assignment
from gateway.core.load import load_table
from gateway.core.router import choose_worker
from gateway.core.types import ClusterView, LoadParams, WorkerView

S = WorkerState
MiB = 1024**2
COST = CostModel.preset("Qwen3-32B", "H100-80G")


# -- the reference definitions (the policies before the fast paths) --------------------------------
def ref_load(w: WorkerView, p: LoadParams) -> float:
    ckpt = w.ckpt_tokens / max(1, w.kv_capacity_tokens)
    queue = (w.running + w.waiting + w.pending) / max(1, p.nominal_batch)
    return p.alpha * ckpt + p.beta * queue


def ref_choose_worker(view: ClusterView, p: LoadParams, exclude: tuple[str, ...] = ()) -> str | None:
    best: tuple[float, str] | None = None
    for w in view.workers.values():
        if w.state not in SERVING_STATES or w.id in exclude:
            continue
        key = (ref_load(w, p), w.id)
        if best is None or key < best:
            best = key
    return None if best is None else best[1]


def _same(a: str, b: str) -> bool:
    return a != "" and a == b


def ref_reassign(
    view: ClusterView, serving: str, alive: tuple[str, ...], need: int, p: HolderParams
) -> tuple[str, ...]:
    count = p.replicas - len(set(alive))
    if count <= 0:
        return ()
    server = view.workers.get(serving)
    banned = server.failure_domain if server is not None and p.exclude_failure_domain else ""
    cands = [
        w
        for w in view.workers.values()
        if w.id != serving
        and w.id not in alive
        and w.state in SERVING_STATES
        and w.ckpt_budget_bytes > 0
        and w.ckpt_budget_bytes - w.ckpt_bytes >= need
        and not _same(w.failure_domain, banned)
    ]
    if p.placement == "ring":
        ordered = sorted(cands, key=lambda w: ring_key(w.id))
        start = ring_key(serving)
        cands = [w for w in ordered if ring_key(w.id) > start] + [
            w for w in ordered if ring_key(w.id) <= start
        ]
    else:
        cands.sort(key=lambda w: (ref_load(w, p.load), w.id))
    chosen: list[str] = []
    domains = {view.workers[h].failure_domain for h in alive if h in view.workers}
    for _ in range(count):
        rest = [w for w in cands if w.id not in chosen]
        if not rest:
            break
        fresh = [w for w in rest if not any(_same(w.failure_domain, d) for d in domains)]
        best = (fresh or rest)[0]
        chosen.append(best.id)
        domains.add(best.failure_domain)
    return tuple(chosen)


def ref_completion_delay(
    w: WorkerView, r: InterruptedRequest, restored: int, p: DispatchParams, cost: CostModel
) -> float:
    batch = p.load.nominal_batch
    ahead = w.running + w.waiting + w.pending
    in_batch = min(ahead, max(0, batch - 1))
    decode = cost.decode_step_time([r.context_tokens] * (in_batch + 1))
    excess = max(0, ahead + 1 - batch)
    wait = excess / max(1, batch) * p.service_steps * decode
    own = r.durable_tokens if w.id in r.holders else 0
    backlog = cost.restore_time(max(0, w.ckpt_tokens - own))
    tail = r.context_tokens - restored
    prefill = cost.step_time(
        StepWork(prefill=((tail, restored),), decode_contexts=(r.context_tokens,) * in_batch)
    )
    return wait + backlog + cost.restore_time(restored) + prefill + r.remaining_tokens * decode


def ref_dispatch(view: ClusterView, r: InterruptedRequest, p: DispatchParams, cost: CostModel) -> Decision:
    survivors = [w for w in view.workers.values() if w.state in SERVING_STATES and w.id != r.failed_worker]
    least = ref_choose_worker(view, p.load, (r.failed_worker,))
    if least is None:
        return Decision("replay", None, "no survivor")
    if p.rule == "replay":
        return Decision("replay", least, "replay rule")
    holders = sorted((w for w in survivors if w.id in r.holders), key=lambda w: (ref_load(w, p.load), w.id))
    if not holders:
        return Decision("replay", least, "no live holder")
    best = holders[0]
    if p.rule == "always_holder":
        return Decision("restore", best.id, "always_holder rule")
    if p.rule == "cost":
        c = r.durable_tokens
        delay, holder = min((ref_completion_delay(h, r, c, p, cost), h.id) for h in holders)
        replay = ref_completion_delay(view.workers[least], r, 0, p, cost)
        if delay <= replay:
            return Decision("restore", holder, f"restore {delay:.3g}s <= replay {replay:.3g}s")
        return Decision("replay", least, f"replay {replay:.3g}s < restore {delay:.3g}s")
    load = ref_load(best, p.load)
    if p.theta_mode == "absolute" or not survivors:
        theta = p.theta
    else:
        mean = math.fsum(ref_load(w, p.load) for w in survivors) / len(survivors)
        theta = p.theta * mean if mean > 0 else p.theta
    if r.durable_tokens > p.tau:
        return Decision("restore", best.id, f"|C_r|={r.durable_tokens} > tau={p.tau}")
    if load <= theta:
        return Decision("restore", best.id, f"L(h)={load:.3g} <= theta_eff={theta:.3g}")
    return Decision(
        "replay",
        least,
        f"L(h)={load:.3g} > theta_eff={theta:.3g} and |C_r|={r.durable_tokens} <= tau={p.tau}",
    )


# -- strategies -------------------------------------------------------------------------------------
IDS = [f"w{i}" for i in range(12)] + ["w01", "w", "a3", "w10x"]


@st.composite
def views(draw: st.DrawFn) -> list[WorkerView]:
    ids = draw(st.lists(st.sampled_from(IDS), min_size=1, max_size=10, unique=True))
    out = []
    for i in ids:
        budget = draw(st.sampled_from([0, 10 * MiB, 100 * MiB]))
        out.append(
            WorkerView(
                id=i,
                state=draw(st.sampled_from([S.HEALTHY, S.HEALTHY, S.HEALTHY, S.SUSPECT, S.FAILED])),
                incarnation=1,
                # small ranges so that equal loads (id tie-breaks) are common
                running=draw(st.integers(0, 4)),
                waiting=draw(st.integers(0, 4)),
                pending=draw(st.integers(0, 2)),
                kv_capacity_tokens=draw(st.sampled_from([1, 1000])),
                ckpt_tokens=draw(st.sampled_from([0, 100, 500, 1000])),
                ckpt_bytes=draw(st.integers(0, budget)),
                ckpt_budget_bytes=budget,
                failure_domain=draw(st.sampled_from(["", "r0", "r1"])),
            )
        )
    return out


load_params = st.builds(
    LoadParams, alpha=st.floats(0, 4), beta=st.floats(0, 4), nominal_batch=st.integers(1, 8)
)
holder_params = st.builds(
    HolderParams,
    load=load_params,
    replicas=st.sampled_from([1, 2]),
    exclude_failure_domain=st.booleans(),
    placement=st.sampled_from(["load_aware", "ring"]),
)
dispatch_params = st.builds(
    DispatchParams,
    load=load_params,
    rule=st.sampled_from(["threshold", "cost", "always_holder", "replay"]),
    theta=st.floats(0, 4),
    theta_mode=st.sampled_from(["relative", "absolute"]),
    tau=st.integers(0, 2048),
)


@st.composite
def evolved(draw: st.DrawFn, p: LoadParams) -> ClusterView:
    """A view reached from a random one by a few incremental changes, its tables used on the way."""
    ws = draw(views())
    view = ClusterView.of(ws)
    for _ in range(draw(st.integers(0, 6))):
        if draw(st.booleans()):
            load_table(view, p)  # the table exists before the change, so it is carried over
        wid = draw(st.sampled_from(sorted(view.workers)))
        w = view.workers[wid]
        kind = draw(st.sampled_from(["assign", "drop", "state", "queue", "new"]))
        if kind == "assign":
            view = with_assignment(view, wid, draw(st.integers(0, 600)), draw(st.integers(0, MiB)))
        elif kind == "drop" and w.ckpt_tokens and w.ckpt_bytes:
            view = with_assignment(view, wid, -w.ckpt_tokens, -w.ckpt_bytes)
        elif kind == "state":
            state = draw(st.sampled_from([S.HEALTHY, S.SUSPECT, S.FAILED]))
            view = view.with_workers([replace(w, state=state)])
        elif kind == "queue":
            view = view.with_workers(
                [replace(w, running=draw(st.integers(0, 6))), replace(w, waiting=draw(st.integers(0, 6)))]
            )
        else:
            new = draw(st.sampled_from(IDS))
            view = view.with_workers([replace(w, id=new)])
    return view


# -- the properties ------------------------------------------------------------------------------------
def test_route_matches_reference(search: settings) -> None:
    search(given(st.data(), load_params)(route_matches_reference))()


def route_matches_reference(data: st.DataObject, p: LoadParams) -> None:
    view = data.draw(evolved(p))
    exclude = tuple(data.draw(st.lists(st.sampled_from(IDS), max_size=3)))
    assert choose_worker(view, p, exclude) == ref_choose_worker(view, p, exclude)
    fresh = ClusterView(dict(view.workers))
    assert choose_worker(fresh, p, exclude) == ref_choose_worker(fresh, p, exclude)


def test_holders_match_reference(search: settings) -> None:
    search(given(st.data(), holder_params, st.integers(0, 20 * MiB))(holders_match_reference))()


def holders_match_reference(data: st.DataObject, p: HolderParams, need: int) -> None:
    view = data.draw(evolved(p.load))
    serving = data.draw(st.sampled_from(IDS))
    alive = tuple(data.draw(st.lists(st.sampled_from(IDS), max_size=2)))
    assert choose_holders(view, serving, need, p) == ref_reassign(view, serving, (), need, p)
    assert reassign_holders(view, serving, alive, need, p) == ref_reassign(view, serving, alive, need, p)


def test_dispatch_matches_reference(search: settings) -> None:
    search(given(st.data(), dispatch_params)(dispatch_matches_reference))()


def dispatch_matches_reference(data: st.DataObject, p: DispatchParams) -> None:
    view = data.draw(evolved(p.load))
    failed = data.draw(st.sampled_from(IDS))  # in the view or not, serving or not
    holders = tuple(data.draw(st.lists(st.sampled_from(IDS), max_size=3)))
    context = data.draw(st.integers(0, 2048))
    req = InterruptedRequest(
        "r", failed, holders, data.draw(st.integers(0, context)), context, data.draw(st.integers(0, 300))
    )
    assert dispatch(view, req, p, COST) == ref_dispatch(view, req, p, COST)


@given(
    st.sampled_from(sorted(MODELS)),
    st.sampled_from(sorted(GPUS)),
    st.integers(1, 8),
    st.integers(0, 300),
    # far beyond real contexts too (large float sums)
    st.integers(0, 10**9),
    st.none() | st.tuples(st.integers(0, 10**6), st.integers(0, 10**9)),
)
def test_uniform_step_time_is_the_cost_models(
    model: str, gpu: str, tp: int, decoding: int, context: int, prefill: tuple[int, int] | None
) -> None:
    cost = CostModel.preset(model, gpu, tp)
    work = StepWork(prefill=(prefill,) if prefill else (), decode_contexts=(context,) * decoding)
    assert uniform_step_time(cost, decoding, context, prefill) == cost.step_time(work)


def test_derived_view_equals_a_fresh_one(search: settings) -> None:
    search(given(st.data(), load_params)(derived_view_equals_a_fresh_one))()


def derived_view_equals_a_fresh_one(data: st.DataObject, p: LoadParams) -> None:
    view = data.draw(evolved(p))
    fresh = ClusterView(dict(view.workers))
    assert view == fresh
    table, ref = load_table(view, p), load_table(fresh, p)
    assert table.ranked == ref.ranked and table.loads == ref.loads
    assert table.total() == ref.total()


def test_a_view_used_with_two_load_params_keeps_a_table_for_each() -> None:
    ws = [
        WorkerView("a", S.HEALTHY, 1, running=4, kv_capacity_tokens=100, ckpt_tokens=0),
        WorkerView("b", S.HEALTHY, 1, running=0, kv_capacity_tokens=100, ckpt_tokens=90),
    ]
    view = ClusterView.of(ws)
    queue_only, ckpt_only = LoadParams(alpha=0.0), LoadParams(beta=0.0)
    for _ in range(2):  # the second round reads the tables (and the memos) kept by the first
        assert choose_worker(view, queue_only) == "b"
        assert choose_worker(view, ckpt_only) == "a"
    view = with_assignment(view, "a", 95, 95)
    assert choose_worker(view, ckpt_only) == "b"
    assert choose_worker(view, queue_only) == "b"


def test_with_assignment_keeps_every_other_field() -> None:
    # every field set to a value other than its default, so a field the fast copy forgot shows
    w = WorkerView(
        "w1", S.SUSPECT, 3, 4, 5, 6, 7, ckpt_tokens=8, ckpt_bytes=9, ckpt_budget_bytes=10,
        failure_domain="r9", pending=11,
    )  # fmt: skip
    assert all(getattr(w, f.name) != f.default for f in fields(WorkerView) if f.init)
    got = with_assignment(ClusterView.of([w]), "w1", 2, 1).workers["w1"]
    assert got == replace(w, ckpt_tokens=10, ckpt_bytes=10)
