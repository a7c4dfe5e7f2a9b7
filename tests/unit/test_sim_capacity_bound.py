"""The capacity bound (`kind = "capacity"`): a failed worker's capacity is gone for its reload, but no
work is lost and nothing waits for detection. What it must and must not do."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gateway.core import evaluation as ev
from gateway.core.modes import policy_for
from gateway.sim.result import RunResult
from gateway.sim.scenario import ScenarioError, parse_scenario
from gateway.sim.simulation import Simulation
from gateway.sim.workload import Workload

AT = 1.0


def run(kind: str, workload: Workload, mode: str = "stop_restart", workers: int = 2, **cluster: Any) -> RunResult:
    s = parse_scenario(
        {
            "cluster": {"workers": workers, **cluster},
            "workload": {"rate": 1.0},
            "failures": [{"at_s": AT, "kind": kind, "workers": ["w0"]}],
        }
    )
    return Simulation(s, policy_for(mode), workload, seed=1).run()


def one(prompt: int, output: int, at: float = 0.0) -> Workload:
    return Workload(np.array([at]), np.array([prompt], dtype=np.int64), np.array([output], dtype=np.int64))


def test_a_running_request_completes_at_the_strike_uninterrupted() -> None:
    (r,) = run("capacity", one(1000, 2000)).records  # decoding on w0 (the first pick) at AT
    assert not r.interrupted and not r.error and r.resume_delay is None
    assert r.output_tokens == 2000 and r.last_token == pytest.approx(AT)
    (killed,) = run("kill", one(1000, 2000)).records
    assert killed.interrupted and killed.last_token > AT  # a kill: resumed, then decoded to its end


def test_a_request_not_yet_prefilled_gets_its_first_token_at_the_strike() -> None:
    # a prompt long enough to be still prefilling at AT (chunked prefill, many chunks)
    (r,) = run("capacity", one(200_000, 10, at=AT - 1e-3), kv_capacity_tokens=400_000).records
    assert r.first_token == pytest.approx(AT) and r.output_tokens == 10 and not r.interrupted


def test_the_reload_starts_at_the_strike_not_at_a_detection() -> None:
    (reload,) = run("capacity", one(100, 10)).stats.reloads
    assert reload.worker == "w0" and reload.started_s == pytest.approx(AT)
    (reload,) = run("kill", one(100, 10)).stats.reloads
    assert reload.started_s > AT  # detection_s later


def test_queued_requests_are_routed_afresh_and_every_request_completes() -> None:
    n = 400
    rng = np.random.default_rng(3)
    w = Workload(
        np.sort(rng.uniform(0.0, 3.0, n)),
        rng.integers(200, 2000, n).astype(np.int64),
        rng.integers(20, 400, n).astype(np.int64),
    )
    for mode in ("stop_restart", "lumen"):
        res = run("capacity", w, mode=mode, workers=3, max_running_requests=4)
        assert len(res.records) == n
        assert not any(r.interrupted or r.error for r in res.records)
        assert sum(r.output_tokens for r in res.records) == int(w.outputs.sum())
        waited = [r for r in res.records if r.first_token is not None and r.first_token > AT + 0.5]
        assert waited, "the load must outlast the strike for this test to mean anything"


def test_losing_no_work_costs_less_than_a_kill_when_the_work_lost_is_large() -> None:
    # long outputs decoding on both workers at the strike: a kill recomputes w0's, the bound does not
    rng = np.random.default_rng(5)
    n = 60
    w = Workload(
        np.sort(rng.uniform(0.0, 0.5, n)),
        np.full(n, 1500, dtype=np.int64),
        np.full(n, 3000, dtype=np.int64),
    )
    kill, bound = run("kill", w), run("capacity", w)
    assert ev.mean_metric(bound.records, "ttft") is not None
    done = [r.last_token for r in kill.records], [r.last_token for r in bound.records]
    assert max(done[1]) < max(done[0])  # the last stream ends sooner: nothing was recomputed


def test_the_kind_is_validated() -> None:
    with pytest.raises(ScenarioError, match=r"failures"):
        parse_scenario({"failures": [{"at_s": 1.0, "kind": "vanish", "workers": ["w0"]}]})


def test_run_scenario_adds_the_bound_beside_the_modes_on_lumens_twin() -> None:
    from gateway.sim.runner import BOUND, capacity_bound, run_scenario

    s = parse_scenario(
        {
            "cluster": {"workers": 4, "model": "Qwen3-8B", "draft_model": "Qwen3-0.6B"},
            "workload": {"rate": 30.0, "duration_s": 40.0},
            "failures": [{"at_s": 15.0, "workers": ["w1"]}, {"at_s": 16.0, "kind": "slow", "workers": ["w2"]}],
        }
    )
    assert [f.kind for f in capacity_bound(s).failures] == ["capacity", "slow"]  # a gray failure stays
    rep = run_scenario(s, ["stop_restart"], 1, bound=True)
    assert set(rep.modes) == {"stop_restart", BOUND} and len(rep.baselines) == 2
    assert rep.baseline_for(BOUND) is rep.baselines[(True, "load_aware")]
    bound, sr = rep.modes[BOUND], rep.modes["stop_restart"]
    assert bound["interrupted"] == 0 and sr["interrupted"] > 0 and bound["client_errors"] == 0
    no_failure = run_scenario(replace(s, failures=()), ["lumen"], 1, bound=True)
    assert set(no_failure.modes) == {"lumen"}  # nothing to bound


def test_lumen_sim_bound_prints_the_row_and_says_what_it_is(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.cli import main

    out = tmp_path / "out"
    args = ["sim", "--scenario", "paper-4w", "--out", str(out), "--duration", "150", "--modes", "lumen"]
    assert main([*args, "--bound", "--quiet", "--no-plots"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["modes"]) == {"lumen", "bound"} and summary["runs"] == 3
    md = (out / "summary.md").read_text()
    assert "| bound |" in md and "capacity bound" in md


def test_the_bound_starts_lumens_recovery_with_the_victim_counted() -> None:
    """Mode lumen keeps its outage levers under the bound: the recovery begins at the strike and the
    survivors' batch boost counts the victim (4 workers, 1 down: 4/3 of 8 slots). With no restart
    the recovery never ends, so the limits are still in force after the run."""
    rng = np.random.default_rng(7)
    n = 200
    w = Workload(
        np.sort(rng.uniform(0.0, 2.0, n)),
        rng.integers(200, 1500, n).astype(np.int64),
        rng.integers(20, 200, n).astype(np.int64),
    )
    s = parse_scenario(
        {
            "cluster": {"workers": 4, "max_running_requests": 8},
            "workload": {"rate": 1.0},
            "recovery": {"restart": False},
            "failures": [{"at_s": AT, "kind": "capacity", "workers": ["w0"]}],
        }
    )
    sim = Simulation(s, policy_for("lumen"), w, seed=1)
    res = sim.run()
    assert len(res.records) == n and not any(r.error or r.interrupted for r in res.records)
    assert sim.coord.outage.recovering and sim.coord.outage.boost == pytest.approx(4 / 3)
    assert [sim.coord.by_id[i].max_running for i in ("w1", "w2", "w3")] == [10, 10, 10]
