"""The policy-cost benchmark runs end to end on a tiny fleet and writes a complete report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROWS = {
    "route",
    "holders",
    "holders+assign",
    "holders+assign r=2 domains",
    "holders+assign ring",
    "view_rebuild",
    "dispatch/threshold",
    "dispatch/cost",
    "dispatch/always_holder",
}


def test_bench_policy_reports_every_row(tmp_path: Path) -> None:
    out = tmp_path / "policy.json"
    args = ["--workers", "8", "--inflight", "200", "--decisions", "30", "--repeats", "1"]
    args += ["--profile-decisions", "5", "--out", str(out)]
    # in a process of its own, as the benchmark runs: with the default --gc on it collects before every
    # row, which in this process means walking what the whole test session holds (~0.25 s a collection)
    proc = subprocess.run(
        [sys.executable, "-m", "loadtests.bench_policy", *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["rows"]) == ROWS
    for name, row in report["rows"].items():
        assert row["n"] == 30, name
        assert 0 < row["p50_us"] <= row["p99_us"] <= row["max_us"], name
    # every timed decision row that missed the goal comes with a profile
    missed = {name for name, row in report["rows"].items() if row["goal_met"] is False}
    assert missed == set(report["profiles"])
