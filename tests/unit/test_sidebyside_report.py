"""The side-by-side report the demo prints (loadtests/sidebyside/report.py, issue 30 item 5): the table
leads with the fair measures (the damage, TTFT over one window common to every mode), and a run that
ended before recovery (recovery time "–") says so and why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gateway.core.evaluation import RequestRecord
from loadtests.sidebyside.report import add_fair_measures, write_report


def recs(ttfts: list[float], start: float = 0.0) -> list[RequestRecord]:
    return [RequestRecord(start + i, start + i + t, start + i + t + 1.0, 10) for i, t in enumerate(ttfts)]


def row(recovery: float | None, **kw: Any) -> dict[str, Any]:
    return {
        "failure_at_s": 2.0,
        "recovery_time_s": recovery,
        "excess_ttft_request_s": 1.5,
        "client_errors": 0,
        **kw,
    }


def test_the_common_window_is_one_window_for_every_mode_and_a_missing_recovery_is_explained(
    tmp_path: Path,
) -> None:
    series = {
        "lumen": recs([0.1] * 10),
        "stop_restart": recs([0.1, 0.1, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]),
    }
    modes = {"lumen": row(1.0), "stop_restart": row(None, reload_s=12.0)}
    add_fair_measures(modes, series)
    # the window runs from the failure (2 s) to the end of the run that never recovered (arrival 9 s)
    assert modes["lumen"]["common_window_s"] == modes["stop_restart"]["common_window_s"] == [2.0, 9.0]
    assert abs(modes["lumen"]["common_window_ttft_mean_s"] - 0.1) < 1e-9
    assert abs(modes["stop_restart"]["common_window_ttft_mean_s"] - 2.0) < 1e-9
    note = modes["stop_restart"]["recovery_note"]
    assert (
        "not recovered before the run ended" in note
        and "7.0 s after the failure" in note
        and "12.0 s" in note
    )
    assert "recovery_note" not in modes["lumen"]
    write_report(tmp_path, {"modes": modes}, series, 2.0)
    md = (tmp_path / "summary.md").read_text()
    header = md.splitlines()[0]
    assert header.startswith("| mode | excess_ttft_request_s | common_window_ttft_mean_s | recovery_time_s |")
    assert "stop_restart: recovery time –: not recovered before the run ended" in md
    assert "| stop_restart | 1.500 | 2.000 | – |" in md
