"""Runs in processes (`run_scenario(jobs=N)`, `lumen sim --jobs N`) give exactly the runs in turn."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import main
from gateway.sim.pool import default_jobs
from gateway.sim.runner import run_scenario
from gateway.sim.scenario import parse_scenario


def test_runs_in_processes_equal_runs_in_turn_and_report_progress() -> None:
    s = parse_scenario(
        {
            "cluster": {"workers": 4, "model": "Qwen3-8B", "draft_model": "Qwen3-0.6B"},
            "workload": {"rate": 40.0, "duration_s": 40.0},
            "failures": [{"at_s": 15.0, "workers": ["w1"]}],
        }
    )
    modes = ["stop_restart", "fixed_checkpoint", "lumen"]
    seen: list[tuple[int, int, str]] = []
    serial = run_scenario(s, modes, 3, bound=True)
    parallel = run_scenario(s, modes, 3, bound=True, jobs=2, progress=lambda i, n, label, t: seen.append((i, n, label)))
    a, b = serial.summary(), parallel.summary()
    a.pop("wall_s"), b.pop("wall_s")
    assert a == b
    assert list(serial.runs) == list(parallel.runs) == [*modes, "bound"]
    for m in serial.runs:
        assert serial.runs[m].records == parallel.runs[m].records
    assert seen and seen[-1] == (7, 7, "done") and all(n == 7 for _, n, _ in seen)


def test_jobs_is_validated(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("-1", "two"):
        with pytest.raises(SystemExit) as exc:
            main(["sim", "--scenario", "paper-4w", "--out", str(tmp_path), "--jobs", bad])
        assert exc.value.code == 2
        assert "--jobs" in capsys.readouterr().err
    assert default_jobs() >= 1


def test_a_tuning_grid_in_processes_equals_the_grid_in_turn() -> None:
    from gateway.sim.tuning import Grid, tune

    s = parse_scenario(
        {
            "cluster": {"workers": 4, "model": "Qwen3-8B", "draft_model": "Qwen3-0.6B"},
            "workload": {"rate": 40.0, "duration_s": 30.0},
            "failures": [{"at_s": 10.0, "workers": ["w1"]}],
        }
    )
    grid = Grid((1.0, 3.0), (0, 512), (1.0,), (1.0,), ("threshold", "cost"))
    serial, parallel = tune(s, grid, 2), tune(s, grid, 2, jobs=2)
    serial.pop("wall_s"), parallel.pop("wall_s")
    assert serial == parallel and len(serial["grid"]) == 4 and len(serial["cost_rule"]) == 1


def test_a_run_that_fails_in_a_process_raises_here() -> None:
    from dataclasses import replace

    from gateway.core.modes import policy_for
    from gateway.sim.pool import Job, run_all
    from gateway.sim.runner import build_workload
    from gateway.sim.scenario import FailureSpec

    s = parse_scenario({"cluster": {"workers": 2}, "workload": {"rate": 20.0, "duration_s": 20.0}})
    bad = replace(s, failures=(FailureSpec(at_s=5.0, workers=("w9",)),))  # no such worker
    plan = [Job("bad", bad, policy_for("lumen"), failures=True), Job("twin", s, policy_for("lumen"), failures=False)]
    with pytest.raises(KeyError, match="w9"):
        run_all(plan, build_workload(s, 1), 1, jobs=2)


def test_without_worker_processes_the_runs_go_in_turn(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where processes cannot be set up (a container without POSIX semaphores: OSError 38), the runs
    go in turn in this process, with a line saying so, and give the same results."""

    from gateway.sim import pool

    class NoSemaphores:
        def Queue(self) -> None:  # the multiprocessing context method
            raise OSError(38, "Function not implemented")

    s = parse_scenario(
        {"cluster": {"workers": 2}, "workload": {"rate": 20.0, "duration_s": 20.0}, "failures": [{"at_s": 5.0, "workers": ["w1"]}]}
    )
    want = run_scenario(s, ["stop_restart", "lumen"], 1).summary()
    monkeypatch.setattr(pool.mp, "get_context", lambda method: NoSemaphores())
    got = run_scenario(s, ["stop_restart", "lumen"], 1, jobs=2, progress=lambda *a: None).summary()
    want.pop("wall_s"), got.pop("wall_s")
    assert got == want
    assert "cannot start worker processes" in capsys.readouterr().err


def test_auto_jobs_keep_small_runs_in_this_process(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`jobs = 0` (the CLI's default) starts processes only for runs large enough to pay for them:
    a small workload never touches multiprocessing (a broken context is not even asked)."""
    from gateway.sim import pool

    def broken(method: str) -> None:
        raise AssertionError("a small run asked for worker processes")

    s = parse_scenario(
        {"cluster": {"workers": 2}, "workload": {"rate": 20.0, "duration_s": 20.0}, "failures": [{"at_s": 5.0, "workers": ["w1"]}]}
    )
    monkeypatch.setattr(pool.mp, "get_context", broken)
    rep = run_scenario(s, ["stop_restart", "lumen"], 1, jobs=0)
    assert rep.requests < pool.AUTO_MIN_REQUESTS and set(rep.modes) == {"stop_restart", "lumen"}
    assert "cannot start" not in capsys.readouterr().err
