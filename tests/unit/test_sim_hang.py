"""Hang failures in the simulator: detected by the live gateway's own silence verdict
(core/detector.py), the hung worker restarted `hung_restart_grace_s` after it was failed."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gateway.core.detector import DetectorParams, hang_detection_s
from gateway.core.modes import policy_for
from gateway.sim.result import RunResult
from gateway.sim.scenario import ScenarioError, parse_scenario
from gateway.sim.simulation import Simulation
from gateway.sim.workload import Workload

AT = 1.0
DETECT = 0.06  # recovery.detection_s: a kill's broken stream


def run(kind: str, workers: int = 2, victims: tuple[str, ...] = ("w0",), **recovery: Any) -> RunResult:
    s = parse_scenario(
        {
            "cluster": {"workers": workers},
            "workload": {"rate": 1.0},
            "recovery": recovery,
            "failures": [{"at_s": AT, "kind": kind, "workers": list(victims)}],
        }
    )
    w = Workload(np.array([0.0]), np.array([1000], dtype=np.int64), np.array([200], dtype=np.int64))
    return Simulation(s, policy_for("stop_restart"), w, seed=1).run()


def test_a_hang_is_detected_by_the_shared_verdict_and_costs_that_much_more_than_a_kill() -> None:
    kill, hang = run("kill"), run("hang")
    detect = hang_detection_s(DetectorParams(), phase_s=AT % 0.02, others=1)
    assert 0.15 < detect < 0.3
    (rk,), (rh,) = kill.records, hang.records
    assert rk.interrupted and rh.interrupted and not rh.error and rh.output_tokens == 200
    assert rh.resume_delay - rk.resume_delay == pytest.approx(detect - DETECT, rel=1e-6)


def test_a_hung_worker_is_restarted_after_the_grace() -> None:
    detect = hang_detection_s(DetectorParams(), phase_s=AT % 0.02, others=1)
    (reload,) = run("hang", hung_restart_grace_s=2.0).stats.reloads
    assert reload.worker == "w0" and reload.started_s == pytest.approx(AT + detect + 2.0)
    (reload,) = run("kill").stats.reloads
    assert reload.started_s == pytest.approx(AT + DETECT)


def test_most_of_the_cluster_hanging_at_once_is_blamed_on_the_gateway_first() -> None:
    res = run("hang", workers=3, victims=("w0", "w1"))
    detected = min(r.started_s for r in res.stats.reloads) - 5.0  # default grace
    assert detected - AT >= 1.0 - 0.02  # health.correlated_silence_s of silence (since the last beat)


def test_the_heartbeat_interval_is_validated() -> None:
    with pytest.raises(ScenarioError, match=r"recovery\.heartbeat_interval_s"):
        run("hang", heartbeat_interval_s=0.0)
    with pytest.raises(ScenarioError, match=r"recovery\.hung_restart_grace_s"):
        run("hang", hung_restart_grace_s=-1.0)
