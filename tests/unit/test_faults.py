"""Fault schedules (loadtests/faults.py): spec parsing and validation, grouping, target resolution."""

import random
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loadtests.faults import (
    DEFAULT_SLOWDOWN,
    GATEWAY_KINDS,
    KINDS,
    SELECTORS,
    UNDO,
    FaultEvent,
    FaultSchedule,
    FaultSpecError,
    parse_fault,
    resolve_group,
)
from loadtests.sidebyside.drive import build_schedule


def worker(
    wid: str, running: int = 0, waiting: int = 0, ckpt: int = 0, state: str = "HEALTHY"
) -> dict[str, Any]:
    return {"id": wid, "state": state, "running": running, "waiting": waiting, "ckpt_tokens": ckpt}


# -- parsing ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "event"),
    [
        ("kill:w0@15", FaultEvent("kill", "w0", 15.0)),
        ("hang:busiest@10+3", FaultEvent("hang", "busiest", 10.0, duration=3.0)),
        ("stall:random@2.5+0.5", FaultEvent("stall", "random", 2.5, duration=0.5)),
        ("slow:w1@10x4", FaultEvent("slow", "w1", 10.0, factor=4.0)),
        ("slow:w1@10:factor=4", FaultEvent("slow", "w1", 10.0, factor=4.0)),
        ("slow:w1@10x4+5", FaultEvent("slow", "w1", 10.0, factor=4.0, duration=5.0)),
        ("slow:top-holder@1:factor=2:duration=3", FaultEvent("slow", "top-holder", 1.0, 2.0, 3.0)),
        ("slow:w2@0", FaultEvent("slow", "w2", 0.0, factor=DEFAULT_SLOWDOWN)),
        (" kill:top-holder@.5 ", FaultEvent("kill", "top-holder", 0.5)),
    ],
)
def test_parse_valid_specs(spec: str, event: FaultEvent) -> None:
    got = parse_fault(spec)
    assert got == event
    assert got.spec == spec


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("kill", "no ':'"),
        ("boom:w0@1", "unknown kind 'boom'"),
        ("kill:w0", "no @SECONDS"),
        ("kill:@1", "neither a worker id"),
        ("kill:w 0@1", "neither a worker id"),
        ("kill:w0@", "is not SECONDS"),
        ("kill:w0@-1", "is not SECONDS"),
        ("kill:w0@soon", "is not SECONDS"),
        ("kill:w0@1+2", "kill cannot be undone"),
        ("hang:w0@1x2", "only slow takes a factor"),
        ("hang:w0@1:factor=2", "only slow takes a factor"),
        ("slow:w0@1x0.5", "outside [1, 1000]"),
        ("slow:w0@1x5000", "outside [1, 1000]"),
        ("slow:w0@1:factor=nan", "outside"),
        ("slow:w0@1:factor=inf", "outside"),
        ("slow:w0@1:factor=fast", "'fast' is not a number"),
        ("slow:w0@1x4:factor=4", "factor is given twice"),
        ("hang:w0@1+2:duration=2", "duration is given twice"),
        ("hang:w0@1+0", "must be a positive"),
        ("hang:w0@1:duration=-1", "must be a positive"),
        ("hang:w0@1:until=2", "not factor=F or duration=D"),
        ("hang:w0@1:", "not factor=F or duration=D"),
    ],
)
def test_bad_specs_name_the_spec_and_the_reason(spec: str, why: str) -> None:
    with pytest.raises(FaultSpecError) as exc:
        parse_fault(spec)
    assert repr(spec) in str(exc.value)
    assert why in str(exc.value)


numbers = st.floats(min_value=0, max_value=1e6, allow_nan=False, allow_infinity=False)
events = st.builds(
    lambda kind, target, at, factor, duration, undo: FaultEvent(
        kind,
        target,
        at,
        factor if kind == "slow" else None,
        duration if undo and kind in UNDO else None,
    ),
    st.sampled_from([k for k in KINDS if k not in GATEWAY_KINDS]),
    st.one_of(st.sampled_from(SELECTORS), st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,8}", fullmatch=True)),
    numbers,
    st.floats(min_value=1, max_value=1000),
    st.floats(min_value=1e-6, max_value=1e6),
    st.booleans(),
)


@given(events)
def test_canonical_spec_parses_back_to_the_same_event(e: FaultEvent) -> None:
    assert parse_fault(str(e)) == e


# -- schedules ---------------------------------------------------------------------------------------


def test_schedule_orders_by_time_and_groups_simultaneous_events() -> None:
    s = FaultSchedule.parse(
        ["kill:top-holder@12", "slow:w1@4x4", "kill:random@12"], victims=["w3"], kill_at=12
    )
    assert [str(e) for e in s.events] == ["slow:w1@4x4", "kill:top-holder@12", "kill:random@12", "kill:w3@12"]
    assert [(at, [e.target for e in g]) for at, g in s.groups()] == [
        (4.0, ["w1"]),
        (12.0, ["top-holder", "random", "w3"]),
    ]
    assert s.first_at == 4.0
    assert not FaultSchedule() and FaultSchedule().first_at is None


def test_same_worker_twice_at_once_is_refused() -> None:
    with pytest.raises(FaultSpecError, match="'kill:w0@3' and 'hang:w0@3' both strike w0"):
        FaultSchedule.parse(["kill:w0@3", "hang:w0@3"])
    FaultSchedule.parse(["kill:random@3", "kill:random@3", "hang:w0@3", "kill:w0@4"])  # fine


def test_unknown_worker_is_refused_with_its_spec() -> None:
    s = FaultSchedule.parse(["kill:w7@1", "kill:random@1"])
    with pytest.raises(FaultSpecError, match=r"'kill:w7@1': no worker 'w7' in this cluster \(w0, w1\)"):
        s.check_workers({"w0", "w1"})
    s.check_workers({f"w{i}" for i in range(8)})


def test_victims_and_kill_at_are_kill_events() -> None:
    assert FaultSchedule.parse([], victims=["w0", "w2"], kill_at=15).events == (
        FaultEvent("kill", "w0", 15.0),
        FaultEvent("kill", "w2", 15.0),
    )


def test_sidebyside_schedule_keeps_the_old_flags_working() -> None:
    def specs(*args: Any) -> list[str]:
        return [str(e) for e in build_schedule(*args).events]

    assert specs([], None, 15.0, 4) == ["kill:w0@15"]  # the old default: w0 killed at --kill-at
    assert specs([], "w1,w2", 9.5, 4) == ["kill:w1@9.5", "kill:w2@9.5"]
    assert specs(["slow:w3@2x4"], None, 15.0, 4) == ["slow:w3@2x4"]  # --fault alone: no default kill
    assert specs(["slow:w3@2x4"], "w0", 15.0, 4) == ["slow:w3@2x4", "kill:w0@15"]
    with pytest.raises(FaultSpecError, match="no worker 'w4'"):
        build_schedule([], "w4", 15.0, 4)


def test_sidebyside_takes_a_slow_scenario_failure_as_slow() -> None:
    from gateway.sim.scenario import load_scenario

    sc = load_scenario("gray")
    got = [str(e) for e in build_schedule([], None, 7.0, sc.cluster.workers, sc, 1).events]
    assert got == ["slow:w0@7x5"]


# -- target resolution ---------------------------------------------------------------------------------


def test_selectors_pick_busiest_and_top_holder_among_healthy_workers() -> None:
    ws = [
        worker("w0", running=9, ckpt=9000, state="FAILED"),  # stale numbers of a dead worker: never picked
        worker("w1", running=5, waiting=1, ckpt=100),
        worker("w2", running=5, waiting=2, ckpt=50),
        worker("w3", running=1, ckpt=4000),
    ]
    rng = random.Random(1)
    assert resolve_group([FaultEvent("kill", "busiest", 1)], ws, rng) == ["w2"]
    assert resolve_group([FaultEvent("kill", "top-holder", 1)], ws, rng) == ["w3"]


def test_explicit_ids_are_taken_as_given() -> None:
    ws = [worker("w0", state="FAILED")]
    assert resolve_group(
        [FaultEvent("kill", "w0", 1), FaultEvent("kill", "w9", 1)], ws, random.Random(0)
    ) == [
        "w0",
        "w9",
    ]


def test_top_holder_ties_go_to_the_busiest_then_the_first_id() -> None:
    ws = [worker("w2", running=3), worker("w0", running=1), worker("w1", running=3)]
    assert resolve_group([FaultEvent("kill", "top-holder", 1)], ws, random.Random(0)) == ["w1"]


def test_group_never_strikes_a_worker_twice_and_random_comes_last() -> None:
    ws = [worker(f"w{i}", running=i, ckpt=10 * i) for i in range(4)]
    group = [
        FaultEvent("kill", "random", 1),
        FaultEvent("kill", "top-holder", 1),
        FaultEvent("kill", "busiest", 1),
        FaultEvent("kill", "w3", 1),
    ]
    got = resolve_group(group, ws, random.Random(5))
    # w3 is taken explicitly, so top-holder is w2 and busiest the next one; random gets what is left
    assert got[1:] == ["w2", "w1", "w3"]
    assert got[0] == "w0"


def test_selector_with_nobody_left_resolves_to_none() -> None:
    ws = [worker("w0"), worker("w1", state="SUSPECT")]
    got = resolve_group(
        [FaultEvent("kill", "busiest", 1), FaultEvent("kill", "random", 1)], ws, random.Random(0)
    )
    assert got == ["w0", None]


@given(
    st.lists(st.tuples(st.integers(0, 20), st.integers(0, 5000), st.booleans()), min_size=1, max_size=8),
    st.lists(st.sampled_from(SELECTORS), min_size=1, max_size=10),
    st.integers(0, 2**32),
)
def test_resolution_properties(loads: list[tuple[int, int, bool]], targets: list[str], seed: int) -> None:
    ws = [
        worker(f"w{i}", running=r, ckpt=c, state="HEALTHY" if ok else "FAILED")
        for i, (r, c, ok) in enumerate(loads)
    ]
    healthy = {w["id"] for w in ws if w["state"] == "HEALTHY"}
    group = [FaultEvent("kill", t, 1.0) for t in targets]
    got = resolve_group(group, ws, random.Random(seed))
    chosen = [g for g in got if g is not None]
    assert set(chosen) <= healthy
    assert len(chosen) == len(set(chosen)) == min(len(group), len(healthy))  # distinct, none left unused
    # reproducible: the same seed and snapshot draw the same workers, whatever order the gateway lists them in
    assert resolve_group(group, list(reversed(ws)), random.Random(seed)) == got
    if set(targets) == {"busiest"}:  # each picks the busiest one left: together, the k busiest
        running = {w["id"]: w["running"] for w in ws}
        top = sorted((running[w] for w in healthy), reverse=True)[: len(chosen)]
        assert [running[g] for g in chosen] == top


def test_the_supervisor_has_a_signal_for_every_signal_fault() -> None:
    """The admin API's fault vocabulary (gateway/protocol/faults.py) and the supervisor's signals agree."""
    from gateway.protocol.faults import FAULT_MODES, FAULT_SIGNALS, SIGNAL_MODES, SPEED_MODES

    assert tuple(FAULT_SIGNALS) == SIGNAL_MODES
    assert set(FAULT_MODES) == set(SIGNAL_MODES) | set(SPEED_MODES)


def test_kill_gateway_takes_a_gateway_index_and_no_duration() -> None:
    e = parse_fault("kill-gateway:1@12")
    assert (e.kind, e.target, e.at, e.duration) == ("kill-gateway", "1", 12.0, None)
    assert parse_fault(str(e)) == e
    for bad in ("kill-gateway:w0@3", "kill-gateway:busiest@3", "kill-gateway:0@3+2", "kill-gateway:0@3x2"):
        with pytest.raises(FaultSpecError):
            parse_fault(bad)
    # a gateway index is not a worker: the schedule's worker check and the selectors leave it alone
    schedule = FaultSchedule.parse(["kill-gateway:0@5", "kill:busiest@5"])
    schedule.check_workers({"w0", "w1"})
    workers = [{"id": "w0", "state": "HEALTHY", "running": 3}, {"id": "w1", "state": "HEALTHY", "running": 1}]
    assert resolve_group(schedule.events, workers, random.Random(0)) == ["0", "w0"]
