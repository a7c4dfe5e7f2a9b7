"""Seeded fast reload (issue 14): the seed choice and the draft-first rule, pure properties and cases."""

import random

from hypothesis import given
from hypothesis import strategies as st

from gateway.core.health import WorkerState
from gateway.core.load import estimated_load
from gateway.core.reload import choose_seed, draft_first, seeded_draft_first_serving_s
from gateway.core.types import ClusterView, LoadParams, WorkerView

S = WorkerState
P = LoadParams(nominal_batch=10)


def w(i: str, state: S = S.HEALTHY, running: int = 0, ckpt: int = 0) -> WorkerView:
    return WorkerView(
        id=i, state=state, incarnation=1, running=running, kv_capacity_tokens=1000, ckpt_tokens=ckpt
    )


@st.composite
def clusters(draw: st.DrawFn) -> tuple[list[WorkerView], str, list[str], dict[str, str] | None]:
    n = draw(st.integers(1, 10))
    ws = []
    states = [S.HEALTHY, S.HEALTHY, S.HEALTHY, S.RESTARTING, S.DRAFT_READY, S.FAILED, S.DEGRADED, S.SUSPECT]
    for i in range(n):
        state = draw(st.sampled_from(states))
        ws.append(w(f"w{i}", state, running=draw(st.integers(0, 20)), ckpt=draw(st.integers(0, 2000))))
    ids = [x.id for x in ws]
    restarting = draw(st.sampled_from(ids))
    busy = draw(st.lists(st.sampled_from(ids), unique=True))
    deployment = draw(
        st.none() | st.dictionaries(st.sampled_from(ids), st.sampled_from(["Qwen3-32B/tp2", "Qwen3-32B/tp4"]))
    )
    return ws, restarting, busy, deployment


params = st.builds(
    LoadParams,
    alpha=st.sampled_from([0.0, 0.5, 1.0]),
    beta=st.sampled_from([0.0, 1.0, 2.0]),
    nominal_batch=st.integers(1, 64),
)


@given(clusters(), params, st.randoms(use_true_random=False))
def test_the_seed_is_the_least_loaded_eligible_survivor_in_any_order(
    c: tuple[list[WorkerView], str, list[str], dict[str, str] | None], p: LoadParams, rnd: random.Random
) -> None:
    ws, restarting, busy, deployment = c
    view = ClusterView.of(ws)
    seed = choose_seed(view, restarting, p, busy, deployment)

    def eligible(x: WorkerView) -> bool:
        if x.id == restarting or x.id in busy or x.state is not S.HEALTHY:
            return False
        if deployment is None:
            return True
        want = deployment.get(restarting)
        return want is not None and deployment.get(x.id) == want

    candidates = sorted((estimated_load(x, p), x.id) for x in ws if eligible(x))
    if seed is None:
        assert not candidates  # disk only when no survivor qualifies
    else:
        # never the restarting worker, never one that is not HEALTHY, never a busy or foreign seed
        assert seed != restarting and view.workers[seed].state is S.HEALTHY and seed not in busy
        assert (estimated_load(view.workers[seed], p), seed) == candidates[0]
    # independent of the order of the view, of busy and of the deployment mapping
    shuffled = ws[:]
    rnd.shuffle(shuffled)
    busy2 = busy[:]
    rnd.shuffle(busy2)
    dep2 = None if deployment is None else dict(sorted(deployment.items(), reverse=True))
    assert choose_seed(ClusterView.of(shuffled), restarting, p, busy2, dep2) == seed
    assert choose_seed(ClusterView.of(shuffled), restarting, p, frozenset(busy), deployment) == seed


def test_least_loaded_healthy_survivor_ties_by_id() -> None:
    view = ClusterView.of(
        [w("w0", S.RESTARTING), w("w1", running=5), w("w2", running=2), w("w3", running=2), w("w4", S.FAILED)]
    )
    assert choose_seed(view, "w0", P) == "w2"  # w2 and w3 tie: the smaller id
    assert choose_seed(view, "w0", P, busy=["w2"]) == "w3"  # w2 already sends to another restart
    assert choose_seed(view, "w0", P, busy=["w2", "w3"]) == "w1"
    assert choose_seed(view, "w0", P, busy=["w1", "w2", "w3"]) is None  # disk


def test_the_load_estimate_counts_checkpoints_held() -> None:
    # w1 holds many checkpoints (it absorbs the failed worker's restores): L̂ = 0.9 + 0.1 > w2's 0.5
    view = ClusterView.of([w("w0", S.RESTARTING), w("w1", running=1, ckpt=900), w("w2", running=5)])
    assert choose_seed(view, "w0", P) == "w2"
    assert choose_seed(view, "w0", LoadParams(alpha=0.0, nominal_batch=10)) == "w1"


def test_no_survivor_means_disk() -> None:
    only = ClusterView.of([w("w0", S.RESTARTING), w("w1", S.DRAFT_READY), w("w2", S.DEGRADED)])
    assert choose_seed(only, "w0", P) is None
    assert choose_seed(ClusterView.of([w("w0", S.RESTARTING)]), "w0", P) is None
    # a worker that is HEALTHY in the view is still never its own seed
    assert choose_seed(ClusterView.of([w("w0")]), "w0", P) is None


def test_same_model_and_tp_only() -> None:
    view = ClusterView.of([w("w0", S.RESTARTING), w("w1"), w("w2", running=9), w("w3")])
    dep = {"w0": "Qwen3-32B/tp2", "w1": "Qwen3-32B/tp4", "w2": "Qwen3-32B/tp2"}
    assert choose_seed(view, "w0", P, deployment=dep) == "w2"  # the busier one, but the same TP
    assert choose_seed(view, "w0", P, deployment={"w1": "Qwen3-32B/tp2"}) is None  # w0's own unknown


def test_draft_first_only_when_the_draft_is_ready_before_the_full_model() -> None:
    assert draft_first(21.7, 36.4)  # full model from disk: draft assist has ~15 s to help
    assert not draft_first(21.7, 20.7)  # seeded from a peer, the full model arrives first
    assert not draft_first(10.0, 10.0)


@given(
    st.floats(0, 100, allow_nan=False), st.floats(0, 10, allow_nan=False), st.floats(0, 100, allow_nan=False)
)
def test_a_seeded_draft_first_restart_never_serves_before_a_plain_seeded_one(
    draft: float, weights: float, peer: float
) -> None:
    t = seeded_draft_first_serving_s(draft, weights, peer)
    assert t >= peer and t >= draft + weights
    assert t in (peer, draft + weights)


def test_with_the_cost_models_times_the_transfer_follows_the_draft() -> None:
    # Qwen3-32B from a peer: 20.73 s (start-up 20 + 0.73 transfer); a 0.6B draft: 20.6 s
    assert seeded_draft_first_serving_s(20.6, 0.73, 20.73) == 20.6 + 0.73
    # a draft given a hand-set 1 s load (which the start-up would not allow) cannot jump the queue
    assert seeded_draft_first_serving_s(1.0, 0.73, 6.8) == 6.8
