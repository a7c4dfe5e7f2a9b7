"""Recovery dispatch (Algorithm 2 and its alternatives) and the mode table."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.core.costmodel import CostModel
from gateway.core.dispatch import Decision, DispatchParams, InterruptedRequest, dispatch
from gateway.core.health import WorkerState
from gateway.core.load import estimated_load
from gateway.core.modes import DISPATCH_RULES, EVALUATION_MODES, MODES, policy_for
from gateway.core.types import ClusterView, LoadParams, WorkerView

S = WorkerState
COST = CostModel.preset("Qwen3-32B", "H100-80G")


def worker(
    i: str, state: S = S.HEALTHY, running: int = 0, waiting: int = 0, ckpt_tokens: int = 0
) -> WorkerView:
    return WorkerView(
        id=i,
        state=state,
        incarnation=1,
        running=running,
        waiting=waiting,
        kv_capacity_tokens=100_000,
        ckpt_tokens=ckpt_tokens,
    )


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[WorkerView], InterruptedRequest]:
    """A failed w0 and 1-7 survivors, some of them holders, in random states and loads."""
    n = draw(st.integers(1, 7))
    ws = [worker("w0", S.FAILED)]
    for i in range(1, n + 1):
        state = draw(st.sampled_from([S.HEALTHY, S.HEALTHY, S.HEALTHY, S.SUSPECT, S.RESTARTING]))
        ws.append(
            worker(
                f"w{i}",
                state,
                running=draw(st.integers(0, 64)),
                waiting=draw(st.integers(0, 64)),
                ckpt_tokens=draw(st.integers(0, 100_000)),
            )
        )
    holders = draw(st.lists(st.sampled_from([w.id for w in ws]), max_size=2, unique=True))
    context = draw(st.integers(0, 4096))
    durable = draw(st.integers(0, context))
    req = InterruptedRequest("r", "w0", tuple(holders), durable, context, draw(st.integers(0, 512)))
    return draw(st.permutations(ws)), req


thresholds = st.builds(
    DispatchParams,
    load=st.builds(LoadParams, alpha=st.floats(0, 4), beta=st.floats(0, 4), nominal_batch=st.integers(1, 64)),
    theta=st.floats(0, 4),
    theta_mode=st.sampled_from(["relative", "absolute"]),
    tau=st.integers(0, 4096),
)


@given(scenarios(), thresholds)
def test_threshold_rule_is_the_papers(
    scenario: tuple[list[WorkerView], InterruptedRequest], p: DispatchParams
) -> None:
    ws, req = scenario
    d = dispatch(ClusterView.of(ws), req, p)
    survivors = [w for w in ws if w.state is S.HEALTHY and w.id != "w0"]
    load = {w.id: estimated_load(w, p.load) for w in survivors}
    if not survivors:
        assert d == Decision("replay", None, "no survivor")
        return
    least = min((load[w.id], w.id) for w in survivors)[1]
    live = sorted((load[h], h) for h in req.holders if h in load)
    if not live:
        assert (d.action, d.worker) == ("replay", least)
        return
    mean = math.fsum(load.values()) / len(load)
    theta = p.theta * mean if p.theta_mode == "relative" and mean > 0 else p.theta
    h_load, h = live[0]
    if h_load <= theta or req.durable_tokens > p.tau:
        assert (d.action, d.worker) == ("restore", h)
    else:
        assert (d.action, d.worker) == ("replay", least)


@given(scenarios(), st.sampled_from(["threshold", "cost", "always_holder", "replay"]), st.data())
def test_decisions_ignore_view_and_holder_order(
    scenario: tuple[list[WorkerView], InterruptedRequest], rule: str, data: st.DataObject
) -> None:
    ws, req = scenario
    p = DispatchParams(rule=rule)  # type: ignore[arg-type]
    shuffled = InterruptedRequest(
        req.rid,
        req.failed_worker,
        tuple(data.draw(st.permutations(req.holders))),
        req.durable_tokens,
        req.context_tokens,
        req.remaining_tokens,
    )
    expected = dispatch(ClusterView.of(ws), req, p, COST)
    assert dispatch(ClusterView.of(data.draw(st.permutations(ws))), shuffled, p, COST) == expected
    if expected.worker is not None:
        w = ClusterView.of(ws).workers[expected.worker]
        assert w.state is S.HEALTHY and w.id != "w0"
        if expected.action == "restore":
            assert w.id in req.holders


def cluster(holder_running: int, other_running: int = 0) -> ClusterView:
    return ClusterView.of(
        [worker("w0", S.FAILED), worker("w1", running=holder_running), worker("w2", running=other_running)]
    )


def test_relative_and_absolute_theta() -> None:
    # loads (beta=1, batch 32): w1 = 48/32 = 1.5, w2 = 16/32 = 0.5; mean 1.0
    view = cluster(48, 16)
    req = InterruptedRequest("r", "w0", ("w1",), durable_tokens=100, context_tokens=200)
    assert dispatch(view, req, DispatchParams(theta=2.0)).action == "restore"  # 1.5 <= 2.0 x 1.0
    assert dispatch(view, req, DispatchParams(theta=1.4)) == Decision(
        "replay", "w2", "L(h)=1.5 > theta_eff=1.4 and |C_r|=100 <= tau=512"
    )
    assert dispatch(view, req, DispatchParams(theta=1.5, theta_mode="absolute")).action == "restore"
    assert dispatch(view, req, DispatchParams(theta=1.4, theta_mode="absolute")).worker == "w2"
    # a long prefix always resumes on its holder
    long = InterruptedRequest("r", "w0", ("w1",), durable_tokens=513, context_tokens=600)
    assert dispatch(view, long, DispatchParams(theta=0.1)) == Decision("restore", "w1", "|C_r|=513 > tau=512")
    at_tau = InterruptedRequest("r", "w0", ("w1",), durable_tokens=512, context_tokens=600)
    assert dispatch(view, at_tau, DispatchParams(theta=0.1)).action == "replay"


def test_idle_cluster_uses_theta_itself() -> None:
    req = InterruptedRequest("r", "w0", ("w1",), durable_tokens=10, context_tokens=20)
    assert dispatch(cluster(0, 0), req, DispatchParams(theta=0.5)).action == "restore"


def test_two_holders_prefer_the_lighter_and_skip_unhealthy() -> None:
    view = ClusterView.of(
        [
            worker("w0", S.FAILED),
            worker("w1", running=40),
            worker("w2", running=8),
            worker("w3", S.SUSPECT),
            worker("w4", running=0),
        ]
    )
    # loads 1.25, 0.25 and 0 for w1, w2, w4 (SUSPECT w3 is no survivor): theta_eff = 2 x 0.5
    req = InterruptedRequest("r", "w0", ("w1", "w2"), durable_tokens=100, context_tokens=100)
    assert dispatch(view, req, DispatchParams()) == Decision("restore", "w2", "L(h)=0.25 <= theta_eff=1")
    suspect_only = InterruptedRequest("r", "w0", ("w3",), durable_tokens=5000, context_tokens=5000)
    assert dispatch(view, suspect_only, DispatchParams()) == Decision("replay", "w4", "no live holder")
    # nothing reported durable yet (heartbeats lag the store): a short prefix on an idle holder
    lagging = InterruptedRequest("r", "w0", ("w2",), durable_tokens=0, context_tokens=100)
    assert dispatch(view, lagging, DispatchParams()) == Decision("restore", "w2", "L(h)=0.25 <= theta_eff=1")
    busy = InterruptedRequest("r", "w0", ("w1",), durable_tokens=0, context_tokens=100)
    assert dispatch(view, busy, DispatchParams()).worker == "w4"


def test_always_holder_and_replay_rules() -> None:
    view = cluster(500)
    req = InterruptedRequest("r", "w0", ("w1",), durable_tokens=1, context_tokens=10)
    assert dispatch(view, req, DispatchParams(rule="always_holder")).worker == "w1"
    assert dispatch(view, req, DispatchParams(rule="replay")) == Decision("replay", "w2", "replay rule")


def test_no_survivor() -> None:
    view = ClusterView.of([worker("w0", S.FAILED), worker("w1", S.SUSPECT)])
    req = InterruptedRequest("r", "w0", ("w1",), durable_tokens=100, context_tokens=100)
    for rule in DISPATCH_RULES:
        d = dispatch(view, req, DispatchParams(rule=rule), COST)  # type: ignore[arg-type]
        assert d == Decision("replay", None, "no survivor")


def test_cost_rule_restores_a_long_prefix_on_an_idle_holder() -> None:
    req = InterruptedRequest(
        "r", "w0", ("w1",), durable_tokens=30_000, context_tokens=30_100, remaining_tokens=50
    )
    # the holder is busier than the replay target, but recomputing 30K tokens costs far more
    d = dispatch(cluster(holder_running=8, other_running=0), req, DispatchParams(rule="cost"), COST)
    assert (d.action, d.worker) == ("restore", "w1")
    # where the threshold rule, with a strict theta and tau out of reach, replays it
    strict = DispatchParams(theta=1.0, tau=10**6)  # L(h) = 0.25 > 1.0 x mean 0.125
    assert dispatch(cluster(8, 0), req, strict).action == "replay"


def test_cost_rule_replays_a_tiny_prefix_from_a_swamped_holder() -> None:
    req = InterruptedRequest("r", "w0", ("w1",), durable_tokens=64, context_tokens=300, remaining_tokens=100)
    d = dispatch(cluster(holder_running=64, other_running=0), req, DispatchParams(rule="cost"), COST)
    assert (d.action, d.worker) == ("replay", "w2")
    swamped = ClusterView.of([worker("w0", S.FAILED), worker("w1", running=32, waiting=400), worker("w2")])
    assert dispatch(swamped, req, DispatchParams(rule="cost"), COST).worker == "w2"


def test_bad_inputs_raise() -> None:
    req = InterruptedRequest("r", "w0", ("w1",), durable_tokens=1, context_tokens=1)
    with pytest.raises(ValueError, match="cost model"):
        dispatch(cluster(0), req, DispatchParams(rule="cost"))
    with pytest.raises(ValueError, match="exceed"):
        InterruptedRequest("r", "w0", ("w1",), durable_tokens=2, context_tokens=1)
    with pytest.raises(ValueError, match="theta_mode"):
        DispatchParams(theta_mode="relatve")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="theta"):
        DispatchParams(theta=float("nan"))
    with pytest.raises(ValueError, match="rule"):
        DispatchParams(rule="random")  # type: ignore[arg-type]


def test_mode_table() -> None:
    assert set(EVALUATION_MODES) <= set(MODES)
    assert policy_for("none").failover is False
    assert policy_for("stop_restart").dispatch == "replay" and not policy_for("stop_restart").checkpointing
    fixed = policy_for("fixed_checkpoint")
    assert (fixed.placement, fixed.dispatch, fixed.draft_assist) == ("ring", "always_holder", False)
    lumen = policy_for("lumen")
    assert (lumen.placement, lumen.dispatch, lumen.draft_assist) == ("load_aware", "threshold", True)
    assert not policy_for("lumen-no-draft").draft_assist
    assert policy_for("lumen-fixed-placement").placement == "ring"
    assert policy_for("lumen-always-holder").dispatch == "always_holder"
    with pytest.raises(ValueError, match="known modes: none, stop_restart"):
        policy_for("dejavu")
