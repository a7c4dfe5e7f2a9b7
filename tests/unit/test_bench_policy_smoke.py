"""The policy-cost benchmark runs end to end on a tiny fleet and writes a complete report."""

from __future__ import annotations

import json
from pathlib import Path

from loadtests import bench_policy

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
    assert bench_policy.main(args) == 0
    report = json.loads(out.read_text())
    assert set(report["rows"]) == ROWS
    for name, row in report["rows"].items():
        assert row["n"] == 30, name
        assert 0 < row["p50_us"] <= row["p99_us"] <= row["max_us"], name
    # every timed decision row that missed the goal comes with a profile
    missed = {name for name, row in report["rows"].items() if row["goal_met"] is False}
    assert missed == set(report["profiles"])
