"""Traces everywhere (issue 17): the reader's errors name file and line, `lumen sim --trace` with
--speedup / --rate / --calibrate-ttft replays the trace (never the generator), a missing trace is an
error unless `workload.fallback = true`, which the summary reports, and reports name their workload."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from gateway.cli import main
from gateway.sim.runner import resolve_workload, with_overrides
from gateway.sim.scenario import parse_scenario
from gateway.sim.workload import TraceError, rate_of, read_trace
from tests.fixtures.traces import HEADER, write_trace


def scenario_file(tmp_path: Path, workload: str = "rate = 20.0\n") -> Path:
    p = tmp_path / "tiny.toml"
    p.write_text(
        '[cluster]\nworkers = 3\nmodel = "Qwen3-8B"\ndraft_model = "Qwen3-0.6B"\n'
        f"[workload]\nduration_s = 30.0\n{workload}"
        '[[failures]]\nat_s = 10.0\nworkers = ["w0"]\n'
    )
    return p


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ("TIMESTAMP,Context,GeneratedTokens\n2023-11-16 18:00:00,1,1\n", r"t\.csv:1: .*ContextTokens"),
        (HEADER + "2023-11-16 18:00:00,10,5\n2023-11-16 18:00:01,ten,5\n", r"t\.csv:3: bad trace row"),
        (HEADER + "2023-11-16 18:00:00,10,-5\n", r"t\.csv:2: negative"),
        (HEADER + "2023-11-16 18:00:00,10\n", r"t\.csv:2: bad trace row"),
        (HEADER, r"t\.csv: the trace has no requests"),
    ],
)
def test_a_malformed_trace_names_file_and_line(tmp_path: Path, body: str, match: str) -> None:
    (tmp_path / "t.csv").write_text(body)
    with pytest.raises(TraceError, match=match):
        read_trace(tmp_path / "t.csv")


def test_a_missing_trace_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"nope\.csv: trace file not found"):
        read_trace(tmp_path / "nope.csv")


def test_overrides_keep_the_trace(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.csv")
    s = parse_scenario({"cluster": {"workers": 3}, "workload": {"rate": 20.0, "duration_s": 30.0}})
    t = with_overrides(s, trace=trace, speedup=3.0)
    wl, info = resolve_workload(t, 1)
    assert (t.workload.source, t.workload.fallback, info["source"], info["speedup"]) == (
        "trace",
        False,
        "trace",
        3.0,
    )
    assert np.array_equal(wl.arrivals, read_trace(trace, 3.0).head(30.0).arrivals)
    # --rate on a trace is a speedup: the trace's mean rate becomes the rate asked for
    r = with_overrides(s, trace=trace, rate=8.0)
    assert r.workload.source == "trace"
    assert rate_of(read_trace(trace, r.workload.trace_speedup)) == pytest.approx(8.0)
    with pytest.raises(ValueError, match="--speedup applies to a trace"):
        with_overrides(s, speedup=2.0)
    with pytest.raises(ValueError, match="not both"):
        with_overrides(s, trace=trace, rate=8.0, speedup=2.0)


def test_fallback_only_for_a_missing_file_and_loudly(tmp_path: Path) -> None:
    s = parse_scenario(
        {
            "cluster": {"workers": 3},
            "workload": {"source": "trace", "trace": str(tmp_path / "gone.csv"), "duration_s": 20.0},
        }
    )
    with pytest.raises(TraceError, match=r"gone\.csv: trace file not found"):
        resolve_workload(s, 1)
    wl, info = resolve_workload(replace(s, workload=replace(s.workload, fallback=True)), 1)
    assert len(wl) > 0 and info["source"] == "synthetic"
    assert info["fallback_for_missing_trace"].endswith("gone.csv") and "TRACE NOT FOUND" in info["warning"]
    # a file that exists but is malformed is an error even with the fallback on
    (tmp_path / "gone.csv").write_text(HEADER + "yesterday,1,1\n")
    with pytest.raises(TraceError, match=r"gone\.csv:2"):
        resolve_workload(replace(s, workload=replace(s.workload, fallback=True)), 1)


def test_lumen_sim_replays_a_trace_and_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "t.csv")
    out = tmp_path / "out"
    argv = ["sim", "--scenario", str(scenario_file(tmp_path)), "--out", str(out), "--quiet", "--no-plots"]
    rc = main([*argv, "--trace", str(trace), "--speedup", "4", "--modes", "stop_restart,lumen"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["workload"]["source"] == "trace" and summary["workload"]["speedup"] == 4.0
    assert summary["workload"]["trace"] == str(trace.resolve())
    assert summary["requests"] == len(read_trace(trace, 4.0).head(30.0))
    assert f"Workload: trace {trace.resolve()} at speedup 4" in (out / "summary.md").read_text()
    assert {"recovery_time_s", "excess_ttft_request_s", "recovery_time_windowed_s"} <= set(
        summary["modes"]["lumen"]
    )
    capsys.readouterr()
    # --calibrate-ttft calibrates the trace's speedup; the workload stays the trace
    rc = main([*argv, "--trace", str(trace), "--calibrate-ttft", "0.3"])
    assert rc == 0
    cal = json.loads(capsys.readouterr().out)
    assert cal["workload"]["source"] == "trace" and cal["speedup"] > 0
    assert cal["ttft_mean_s"] == pytest.approx(0.3, rel=0.25)
    # errors name the file (and the line)
    assert main([*argv, "--trace", str(tmp_path / "nope.csv")]) == 2
    assert "nope.csv: trace file not found" in capsys.readouterr().err
    (tmp_path / "bad.csv").write_text(HEADER + "2023-11-16 18:00:00,1,1\nnot a time,1,2\n")
    with pytest.raises(SystemExit):
        main([*argv, "--trace", str(tmp_path / "bad.csv"), "--rate", "3"])
    assert "bad.csv:3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*argv, "--speedup", "2"])
    assert "--speedup applies to a trace" in capsys.readouterr().err


def test_a_synthetic_summary_names_its_shape(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["sim", "--scenario", str(scenario_file(tmp_path)), "--out", str(out), "--quiet", "--no-plots"]
    assert main([*argv, "--modes", "lumen", "--duration", "20"]) == 0
    w = json.loads((out / "summary.json").read_text())["workload"]
    assert (w["source"], w["shape"], w["rate_rps"]) == ("synthetic", "conv", 20.0)
