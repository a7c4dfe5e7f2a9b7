"""Router and load estimate: pure properties."""

from hypothesis import given
from hypothesis import strategies as st

from gateway.core.health import WorkerState
from gateway.core.load import estimated_load
from gateway.core.router import choose_worker, routing_params
from gateway.core.types import ClusterView, LoadParams, WorkerView

states = st.sampled_from(list(WorkerState))


@st.composite
def workers(draw: st.DrawFn, min_size: int = 0) -> list[WorkerView]:
    n = draw(st.integers(min_value=min_size, max_value=12))
    ids = draw(st.lists(st.text("abcdw0123", min_size=1, max_size=4), min_size=n, max_size=n, unique=True))
    return [
        WorkerView(
            id=i,
            state=draw(states),
            incarnation=1,
            running=draw(st.integers(0, 64)),
            waiting=draw(st.integers(0, 64)),
            kv_capacity_tokens=draw(st.integers(1, 10**6)),
            ckpt_tokens=draw(st.integers(0, 10**6)),
            pending=draw(st.integers(0, 8)),
        )
        for i in ids
    ]


params = st.builds(
    LoadParams, alpha=st.floats(0, 4), beta=st.floats(0.01, 4), nominal_batch=st.integers(1, 256)
)


@given(workers(), params, st.randoms())
def test_choice_ignores_candidate_order(ws: list[WorkerView], p: LoadParams, rnd) -> None:
    shuffled = list(ws)
    rnd.shuffle(shuffled)
    assert choose_worker(ClusterView.of(ws), p) == choose_worker(ClusterView.of(shuffled), p)


@given(workers(), params)
def test_choice_is_a_healthy_minimum(ws: list[WorkerView], p: LoadParams) -> None:
    view = ClusterView.of(ws)
    chosen = choose_worker(view, p)
    healthy = [w for w in ws if w.state is WorkerState.HEALTHY]
    if not healthy:
        assert chosen is None
        return
    best = min((estimated_load(w, p), w.id) for w in healthy)
    assert chosen == best[1]


@given(workers(min_size=1), params)
def test_excluded_workers_are_never_chosen(ws: list[WorkerView], p: LoadParams) -> None:
    excluded = {ws[0].id}
    assert choose_worker(ClusterView.of(ws), p, exclude=excluded) not in excluded


@given(st.integers(0, 500), st.integers(0, 500), st.integers(1, 100), params)
def test_load_is_monotone_in_queue_depth(running: int, waiting: int, extra: int, p: LoadParams) -> None:
    w = WorkerView(id="a", state=WorkerState.HEALTHY, incarnation=1, running=running, waiting=waiting)
    more = WorkerView(
        id="a", state=WorkerState.HEALTHY, incarnation=1, running=running, waiting=waiting + extra
    )
    assert estimated_load(more, p) > estimated_load(w, p)


def test_ties_break_by_id() -> None:
    ws = [WorkerView(id=i, state=WorkerState.HEALTHY, incarnation=1) for i in ("w2", "w0", "w1")]
    assert choose_worker(ClusterView.of(ws), LoadParams()) == "w0"


def test_checkpoint_load_counts_against_a_worker() -> None:
    light = WorkerView(id="b", state=WorkerState.HEALTHY, incarnation=1, kv_capacity_tokens=1000)
    holder = WorkerView(
        id="a", state=WorkerState.HEALTHY, incarnation=1, kv_capacity_tokens=1000, ckpt_tokens=500
    )
    assert choose_worker(ClusterView.of([light, holder]), LoadParams(alpha=1.0, beta=1.0)) == "b"
    # with alpha = 0 checkpoints do not count and the id tie-break picks "a"
    assert choose_worker(ClusterView.of([light, holder]), LoadParams(alpha=0.0, beta=1.0)) == "a"


def test_only_healthy_workers_are_routed_to() -> None:
    ws = [
        WorkerView(id="a", state=WorkerState.SUSPECT, incarnation=1),
        WorkerView(id="b", state=WorkerState.DRAFT_READY, incarnation=1),
        WorkerView(id="c", state=WorkerState.HEALTHY, incarnation=1, running=50),
    ]
    assert choose_worker(ClusterView.of(ws), LoadParams()) == "c"


@given(workers(min_size=1), params)
def test_new_requests_are_routed_by_queue_unless_checkpoint_aware(
    ws: list[WorkerView], p: LoadParams
) -> None:
    view = ClusterView.of(ws)
    chosen = choose_worker(view, routing_params(p))
    serving = [w for w in ws if w.state is WorkerState.HEALTHY]
    if not serving:
        assert chosen is None
        return
    # the least running + waiting + pending, whatever checkpoints the workers hold
    assert chosen == min(serving, key=lambda w: (w.running + w.waiting + w.pending, w.id)).id
    assert choose_worker(view, routing_params(p, checkpoint_aware=True)) == choose_worker(view, p)
