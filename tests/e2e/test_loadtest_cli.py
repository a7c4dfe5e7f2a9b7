"""`lumen loadtest` end to end (the interface contract of issue 7): a short side-by-side run against
real local clusters writes summary.json with the same per-mode keys as `lumen sim`, a Markdown table
and the timelines, and no mode but `none` shows a client error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.traces import write_trace

SIM_KEYS = {
    "ttft_mean_s",
    "tpot_mean_s",
    "recovery_time_s",
    "excess_ttft_request_s",
    "impact_ttft_mean_s",
    "impact_tpot_mean_s",
    "client_errors",
    "reload_source",
    "reload_s",
}


TIMEOUT_S = 200  # the short case takes ~20 s here, two clusters started, a worker killed, and stopped


def _text(b: bytes | str | None) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def _logs(out: Path, n: int = 1500) -> str:
    """The tail of every log the run's clusters wrote (what a failure is read from)."""
    tails = [f"\n--- {p}:\n{p.read_text(errors='replace')[-n:]}" for p in sorted(out.glob("logs/*/*.log"))]
    return "".join(tails)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize(
    ("modes", "run"),
    [
        # one mode (and its no-failure reference), a short and light load replayed from a trace: two
        # clusters, not three
        pytest.param(
            "lumen",
            ["--duration", "2", "--kill-at", "1", "--model-load-s", "0.5", "--scale", "0.2", "--trace", "T"],
            id="short-trace",
        ),
        pytest.param(
            "none,lumen",
            ["--duration", "6", "--kill-at", "2.5", "--model-load-s", "2"],
            id="full",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_loadtest_writes_the_sim_contract(tmp_path: Path, modes: str, run: list[str]) -> None:
    out = tmp_path / "lt"
    cmd = [sys.executable, "-m", "gateway.cli", "loadtest", "--scenario", "paper-4w", "--out", str(out)]
    if "T" in run:  # a generated trace at 6 req/s (--rate on a trace sets its speedup)
        run = [str(write_trace(tmp_path / "t.csv", n=60, rate=3.0)) if a == "T" else a for a in run]
    cmd += ["--modes", modes, "--rate", "6", *run]
    # a stuck stream ends the run (exit 1, listed) 40 s after the last arrival, inside pytest's timeout
    cmd += ["--max-running", "8", "--set", "engine.page_size=16", "--poll", "0.5", "--drain-s", "40"]
    # each cluster's gateway cancels its workers' control streams 0.05 s into its stop, not 0.5 s
    cmd += ["--set", "timeouts.control_stop_grace_s=0.05"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S - 10)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"loadtest ran past {exc.timeout} s; stderr: {_text(exc.stderr)[-3000:]}{_logs(out)}")
    assert proc.returncode == 0, proc.stderr[-3000:] + _logs(out)
    summary = json.loads((out / "summary.json").read_text())
    assert {"workers", "simulated_s", "wall_s", "seed"} <= set(summary)
    assert set(summary["modes"]) == set(modes.split(","))
    assert summary["workload"]["source"] == ("trace" if "--trace" in run else "synthetic")
    for mode, row in summary["modes"].items():
        assert set(row) >= SIM_KEYS, (mode, sorted(row))
        assert row["requests"] > 0 and row["faults"], row
        assert row["reload_source"] in (None, "disk"), row  # a killed worker reloads from storage here
    assert summary["modes"]["lumen"]["client_errors"] == 0
    table = (out / "summary.md").read_text()
    assert all(f"| {mode} |" in table for mode in summary["modes"])
    assert (out / "timeline.png").stat().st_size > 0
    runs = json.loads((out / "records.json").read_text())["runs"]
    assert len(runs[next(iter(summary["modes"]))]) == summary["requests"]
