"""`lumen loadtest`'s workload (loadtests/sidebyside/workload.py): the generator by default, a trace with
--speedup, --rate (as a speedup) or --calibrate-ttft, conflicting flags and bad traces refused with the
flag or the file named."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gateway.sim.workload import TraceError, rate_of, read_trace, workload_label
from loadtests.sidebyside.workload import DEFAULT_RATE, LoadError, build_load
from tests.fixtures.traces import write_trace


def args(**kw: Any) -> argparse.Namespace:
    base: dict[str, Any] = {
        "trace": None,
        "speedup": None,
        "rate": None,
        "calibrate_ttft": None,
        "seed": 1,
        "duration": 30.0,
        "scale": 0.5,
        "workers": 3,
        "model": "Qwen3-8B",
        "max_running": 8,
        "time_scale": 2.0,
    }
    return argparse.Namespace(**{**base, **kw})


def test_the_generator_by_default() -> None:
    shapes, info = build_load(args())
    assert (
        info["source"] == "synthetic" and info["rate_rps"] == DEFAULT_RATE and info["requests"] == len(shapes)
    )
    assert "synthetic conv workload" in workload_label(info)


def test_a_trace_with_a_speedup_is_replayed(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.csv")
    shapes, info = build_load(args(trace=trace, speedup=2.0))
    ref = read_trace(trace, 2.0).head(30.0)
    assert [s.at for s in shapes] == pytest.approx(ref.arrivals.tolist())
    # lengths scaled by --scale, with the floors of a CPU box
    assert [s.prompt_tokens for s in shapes] == np.maximum(8, (ref.prompts * 0.5).astype(int)).tolist()
    assert (info["source"], info["speedup"], info["length_scale"]) == ("trace", 2.0, 0.5)
    assert f"trace {trace} at speedup 2" in workload_label(info)


def test_rate_acts_as_a_speedup_on_a_trace(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.csv")
    _, info = build_load(args(trace=trace, rate=6.0))
    assert rate_of(read_trace(trace, info["speedup"])) == pytest.approx(6.0)
    assert info["speedup_from_rate_rps"] == 6.0


def test_calibrate_ttft_picks_the_trace_speedup(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.csv", n=400)
    shapes, info = build_load(args(trace=trace, calibrate_ttft=0.4))
    assert info["source"] == "trace" and info["calibrated_ttft_s"] == 0.4
    assert info["calibration_sim_ttft_s"] == pytest.approx(0.4, rel=0.25)
    assert len(shapes) == info["requests"] > 0
    assert "calibrated to no-failure TTFT 0.4 s" in workload_label(info)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"speedup": 2.0}, "--speedup needs --trace"),
        ({"calibrate_ttft": 1.0}, "--calibrate-ttft needs --trace"),
        ({"trace": "T", "speedup": 2.0, "rate": 3.0}, "give one of"),
        ({"trace": "T", "speedup": 0.0}, "--speedup must be > 0"),
    ],
)
def test_conflicting_flags_are_refused(tmp_path: Path, kw: dict[str, Any], match: str) -> None:
    if kw.get("trace") == "T":
        kw = {**kw, "trace": write_trace(tmp_path / "t.csv")}
    with pytest.raises(LoadError, match=match):
        build_load(args(**kw))


def test_a_bad_trace_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"gone\.csv: trace file not found"):
        build_load(args(trace=tmp_path / "gone.csv", speedup=1.0))
    (tmp_path / "bad.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,x,1\n")
    with pytest.raises(TraceError, match=r"bad\.csv:2"):
        build_load(args(trace=tmp_path / "bad.csv"))
