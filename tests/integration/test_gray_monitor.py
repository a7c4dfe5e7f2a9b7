"""The live monitor's gray-failure books: measured time per token, verdicts, migration, probation."""

from __future__ import annotations

from gateway.core.gray import GrayParams
from gateway.core.health import WorkerState
from gateway.protocol import control_pb2 as pb
from gateway.server.workers.monitor import LoadMonitor
from tests.fixtures.clock import FakeClock


def make(n: int = 4) -> tuple[FakeClock, LoadMonitor]:
    clock = FakeClock()
    mon = LoadMonitor(clock=clock, heartbeat_interval_s=0.02, heartbeat_misses=3)
    for i in range(n):
        mon.attach(pb.Hello(protocol_version=1, worker_id=f"w{i}", incarnation=1, phase=pb.SERVING))
    return clock, mon


def stream(clock: FakeClock, mon: LoadMonitor, per_token: dict[str, float], seconds: float) -> None:
    """Every worker streams one token per step of its own speed for `seconds`."""
    end = clock.t + seconds
    while clock.t < end:
        clock.t += 0.01
        for wid, dt in per_token.items():
            mon.observe_tokens(wid, 1, 1, dt)


def test_a_slow_worker_is_degraded_its_streams_interrupted_and_trusted_after_probation() -> None:
    clock, mon = make()
    reasons: list[str] = []
    mon.watch("w3", 1, reasons.append)
    stream(clock, mon, {"w0": 0.02, "w1": 0.021, "w2": 0.019, "w3": 0.02}, 1.0)
    mon.check_gray(GrayParams(), window_s=1.0, probation_s=3.0)
    assert all(r.state is WorkerState.HEALTHY for r in mon.workers.values())
    stream(clock, mon, {"w0": 0.02, "w1": 0.021, "w2": 0.019, "w3": 0.12}, 4.0)  # w3 slows 6x
    mon.check_gray(GrayParams(), window_s=1.0, probation_s=3.0)
    assert mon.workers["w3"].state is WorkerState.DEGRADED
    assert reasons and reasons[0].startswith("degraded")
    assert not mon.workers["w3"].watchers  # its streams were told once
    # no longer measured (its requests moved); before probation ends it stays degraded
    stream(clock, mon, {"w0": 0.02, "w1": 0.02, "w2": 0.02}, 2.0)
    mon.check_gray(GrayParams(), window_s=1.0, probation_s=3.0)
    assert mon.workers["w3"].state is WorkerState.DEGRADED
    stream(clock, mon, {"w0": 0.02, "w1": 0.02, "w2": 0.02}, 1.5)
    mon.check_gray(GrayParams(), window_s=1.0, probation_s=3.0)
    assert mon.workers["w3"].state is WorkerState.HEALTHY
    assert mon.workers["w3"].per_token_at is None  # measured afresh from now on


def test_one_slow_step_is_not_a_verdict_and_stale_measurements_do_not_count() -> None:
    clock, mon = make(3)
    stream(clock, mon, {"w0": 0.02, "w1": 0.02}, 1.0)
    mon.observe_tokens("w2", 1, 1, 0.5)  # one token after a long prefill step: below token_min
    mon.check_gray(GrayParams(), window_s=1.0, probation_s=3.0)
    assert mon.workers["w2"].state is WorkerState.HEALTHY
    clock.t += 10  # every measurement is stale: no verdicts
    mon.observe_tokens("w2", 1, 64, 64 * 0.2)
    mon.check_gray(GrayParams(), window_s=1.0, probation_s=3.0)
    assert mon.workers["w2"].state is WorkerState.HEALTHY


def test_without_migration_the_streams_finish_where_they_are() -> None:
    clock, mon = make(3)
    reasons: list[str] = []
    mon.watch("w2", 1, reasons.append)
    stream(clock, mon, {"w0": 0.02, "w1": 0.02, "w2": 0.2}, 2.0)
    mon.check_gray(GrayParams(), window_s=1.0, probation_s=3.0, migrate=False)
    assert mon.workers["w2"].state is WorkerState.DEGRADED and reasons == []
