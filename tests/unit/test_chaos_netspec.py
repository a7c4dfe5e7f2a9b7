"""Network fault specs (loadtests/chaos/netspec.py), their place in the fault-schedule language, and
the randomized schedules of `lumen chaos` (reproducible from the seed)."""

from __future__ import annotations

import pytest

from loadtests.chaos.netspec import NetSpecError, check_hosts, expand, parse_net_fault
from loadtests.chaos.plan import split_faults
from loadtests.chaos.randomplan import random_faults
from loadtests.faults import FaultSpecError, parse_fault

HOSTS = ["gw0", "gw1", "w0", "w1", "w2", "client"]


def test_partition_forms() -> None:
    f = parse_net_fault("partition:gw0|w0,w1@5+3")
    assert (f.kind, f.side_a, f.side_b, f.one_way, f.at, f.duration) == (
        "partition",
        ("gw0",),
        ("w0", "w1"),
        False,
        5.0,
        3.0,
    )
    one = parse_net_fault("partition:w0>gw@2.5")
    assert one.one_way and one.side_b == ("gw",) and one.duration is None
    assert str(one) == "partition:w0>gw@2.5"
    assert parse_net_fault(str(f)) == f


def test_options_and_round_trip() -> None:
    assert parse_net_fault("loss:all@5+10:pct=10").option("pct") == "10"
    assert parse_net_fault("bw:w1@3+5:rate=2mbit").option("rate") == "2mbit"
    d = parse_net_fault("delay:all@1:ms=50:jitter=50")
    assert (d.option("ms"), d.option("jitter")) == ("50", "50")
    assert parse_net_fault(str(d)) == d


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("partition:gw0@5", "two sides"),
        ("partition:all|all@5", "only one side"),
        ("loss:all@5", "pct=N is required"),
        ("loss:all@5:pct=0", "must be in (0, 100]"),
        ("loss:w0|w1@5:pct=5", "one set of hosts"),
        ("bw:w0@1:rate=fast", "rate=N with a unit"),
        ("delay:all@1:ms=10:jitter=20", "jitter <= ms"),
        ("loss:all@1:pct=5:pct=6", "given twice"),
        ("loss:all@1:rate=5", "loss takes pct"),
        ("partition:w0|gw@-1", "non-negative"),
        ("partition:w0|gw@1+0", "positive"),
        ("partition:w0|g w@1", "neither a host name"),
        ("partition:w0|gw", "no @SECONDS"),
    ],
)
def test_bad_specs_say_why(spec: str, why: str) -> None:
    with pytest.raises(NetSpecError, match="network fault spec") as info:
        parse_net_fault(spec)
    assert why in str(info.value)
    assert spec in str(info.value)


def test_groups_expand_against_the_lab() -> None:
    assert expand(["gw"], HOSTS) == ["gw0", "gw1"]
    assert expand(["workers", "client"], HOSTS) == ["w0", "w1", "w2", "client"]
    assert expand(["all"], HOSTS, exclude=["gw1"]) == ["gw0", "w0", "w1", "w2", "client"]
    check_hosts([parse_net_fault("partition:gw1|all@1")], HOSTS)
    with pytest.raises(NetSpecError, match="no host 'w7'"):
        check_hosts([parse_net_fault("partition:w7|gw@1")], HOSTS)
    with pytest.raises(NetSpecError, match="overlap"):
        check_hosts([parse_net_fault("partition:w0,w1|w1@1")], HOSTS)


def test_one_schedule_mixes_process_and_network_faults() -> None:
    schedule, net = split_faults(["kill:w0@3", "partition:w1|gw@2+1", "hang:w2@4+1", "loss:all@0:pct=5"])
    assert [e.kind for e in schedule.events] == ["kill", "hang"]
    assert [f.kind for f in net] == ["partition", "loss"]


def test_loadtest_refuses_network_faults_clearly() -> None:
    with pytest.raises(FaultSpecError, match="network fault: `lumen chaos` runs those"):
        parse_fault("partition:w0|gw@5+3")


def test_random_schedules_are_reproducible_and_valid() -> None:
    kw = {"gateways": ["gw0", "gw1"], "workers": ["w0", "w1", "w2"], "delay": False}
    a = random_faults(7, 60.0, 12.0, **kw)  # type: ignore[arg-type]
    assert a == random_faults(7, 60.0, 12.0, **kw)  # type: ignore[arg-type]
    assert a != random_faults(8, 60.0, 12.0, **kw)  # type: ignore[arg-type]
    assert len(a) == 12
    assert not any(s.startswith("delay") for s in a)  # no delay possible: never drawn
    schedule, net = split_faults(a)
    schedule.check_workers(["w0", "w1", "w2"])
    check_hosts(net, HOSTS)
    one_gw = random_faults(3, 120.0, 30.0, gateways=["gw0"], workers=["w0"], delay=True)
    assert not any(s.startswith(("kill-gateway", "partition:gw0|all")) for s in one_gw)
    with pytest.raises(ValueError, match="at least 6 s"):
        random_faults(1, 5.0, 6.0, **kw)  # type: ignore[arg-type]


def test_progress_lines_read_as_people_would() -> None:
    from loadtests.chaos.orchestrate import _progress_text

    line = "2026-11-26 22:00:10 [info     ] chaos_progress   ended=12 faults=3 requests=7200 t=90"
    assert _progress_text(line) == "t=90 s: 12/7200 requests ended, 3 faults fired"
