"""The side-by-side report: per-mode metrics (`gateway.core.evaluation`, as the simulator) and the files
summary.json, summary.md, timelines.json and records.json; the plots are loadtests/sidebyside/plots.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gateway.core import evaluation as ev
from gateway.core import excess as ex
from gateway.sim.workload import workload_label
from loadtests.faults import FaultSchedule
from loadtests.sidebyside.plots import plot_timelines


def summarize(
    failed: list[ev.RequestRecord], base: list[ev.RequestRecord], failure_at: float
) -> dict[str, Any]:
    """The per-mode row: recovery against the no-failure twin (docs/evaluation.md; the requests pair by
    index, the same workload in both runs) and EVALUATION's original windowed rule for comparison."""
    twin = ex.measure(failed, base, failure_at, "ttft")
    rec = twin.recovery_s
    rec_tpot = ex.measure(failed, base, failure_at, "tpot").recovery_s
    impact = ev.failure_impact(failed, failure_at, rec)
    out = ev.outcomes(failed)
    return {
        "ttft_mean_s": ev.mean_metric(failed, "ttft"),
        "tpot_mean_s": ev.mean_metric(failed, "tpot"),
        "recovery_time_s": rec,
        "recovery_time_tpot_s": rec_tpot,
        "recovery_time_windowed_s": ev.windowed_recovery_time(failed, base, failure_at, "ttft"),
        "excess_ttft_request_s": twin.excess_request_s,
        "impact_ttft_mean_s": impact.mean_ttft,
        "impact_tpot_mean_s": impact.mean_tpot,
        "impact_requests": impact.requests,
        "client_errors": out.errors,
        "requests": out.total,
        "interrupted": out.interrupted,
        "no_failure_ttft_mean_s": ev.mean_metric(base, "ttft"),
        "no_failure_tpot_mean_s": ev.mean_metric(base, "tpot"),
    }


def add_fair_measures(modes: dict[str, dict[str, Any]], series: dict[str, list[ev.RequestRecord]]) -> None:
    """The measures that compare modes fairly, added to each mode's row: the mean TTFT over ONE window
    shared by every mode (`common_window_ttft_mean_s`: from the failure to the latest recovery among
    the modes, to the last arrival where a mode did not recover; each mode's own impact window differs
    with its recovery time, so impact means are not a fair ratio), its bounds, and, where the run ended
    before recovery (recovery time "–"), why (`recovery_note`)."""
    ends = []
    for m, row in modes.items():
        recs = series.get(m, [])
        last = max((r.arrival for r in recs), default=row["failure_at_s"])
        rec = row.get("recovery_time_s")
        ends.append(row["failure_at_s"] + rec if rec is not None else last)
        if rec is None:
            row["recovery_note"] = not_recovered_note(row, last)
    end = max(ends, default=0.0)
    for m, row in modes.items():
        start = row["failure_at_s"]
        window = [r for r in series.get(m, []) if start <= r.arrival <= end]
        row["common_window_ttft_mean_s"] = ev.mean_metric(window, "ttft") if window else None
        row["common_window_s"] = [round(start, 3), round(end, 3)]


def not_recovered_note(row: dict[str, Any], last_arrival: float) -> str:
    """Why a run has no recovery time: it ended before its TTFT came back within the no-failure run's."""
    left = last_arrival - row["failure_at_s"]
    why = (
        f"not recovered before the run ended: its last request arrived {left:.1f} s after the failure, "
        "with TTFT still above the no-failure run's bound (docs/evaluation.md)"
    )
    if row.get("client_errors"):
        why += f"; {row['client_errors']} request(s) failed"
    reload_s = row.get("reload_s")
    if isinstance(reload_s, (int, float)) and reload_s > 0:
        why += f"; the failed worker's reload took {reload_s:.1f} s"
    return (
        why
        + ". The damage (excess request-s) and the common-window TTFT still compare the modes; a longer run (--duration) shows the recovery."
    )


def first_fault_at(fired: list[dict[str, Any]], schedule: FaultSchedule) -> float:
    """When the first fault struck (recovery is measured from there); the planned time if none did."""
    struck = [f["t"] for f in fired if f["ok"] and f["undo_of"] is None]
    return min(struck) if struck else float(schedule.first_at or 0.0)


def fmt(v: object) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def write_report(
    out: Path,
    summary: dict[str, Any],
    series: dict[str, list[ev.RequestRecord]],
    failure_at: float,
    timelines: dict[str, dict[str, Any]] | None = None,
) -> None:
    """summary.json, summary.md, timelines.json, records.json and (with matplotlib) timeline.png +
    queues-MODE.png.

    `timelines` is keyed like `series`: per run its polled worker `queue`, the `faults` fired, and for
    faulted runs `failure_at` and `recovery_time_s`."""
    timelines = timelines or {}
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if timelines:
        (out / "timelines.json").write_text(json.dumps(timelines))
    # every run's client records, in workload order (the twin pairs by index): the measure can be
    # recomputed with other parameters without rerunning the clusters
    fields = ("arrival", "first_token", "last_token", "output_tokens", "interrupted", "error")
    records = {name: [[getattr(r, f) for f in fields] for r in recs] for name, recs in series.items()}
    (out / "records.json").write_text(json.dumps({"fields": fields, "runs": records}))
    modes = summary["modes"]
    # the fair measures first: the damage, and TTFT over one window common to every mode
    cols = [
        "excess_ttft_request_s",
        "common_window_ttft_mean_s",
        "recovery_time_s",
        "ttft_mean_s",
        "tpot_mean_s",
        "impact_ttft_mean_s",
        "impact_tpot_mean_s",
        "client_errors",
        "interrupted",
        "restores",
        "replays",
        "restored_tokens",
    ]
    lines = []
    if summary.get("workload"):
        lines += [f"Workload: {workload_label(summary['workload'])}.", ""]
    lines += ["| mode | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for m, row in modes.items():
        lines.append(f"| {m} | " + " | ".join(fmt(row.get(c)) for c in cols) + " |")
    window = next((row["common_window_s"] for row in modes.values() if "common_window_s" in row), None)
    if window:
        lines += ["", f"excess_ttft_request_s: the damage; common window: {window[0]:.1f}-{window[1]:.1f} s."]
    for m, row in modes.items():
        if row.get("recovery_note"):
            lines += ["", f"{m}: recovery time –: {row['recovery_note']}"]
    ref = modes.get("stop_restart")
    if ref:
        lines += [
            "",
            "Ratios to stop_restart (lower is better):",
            "",
            "| mode | excess request-s | common-window TTFT | recovery | TTFT | TPOT | impact TTFT |",
            "|---|---|---|---|---|---|---|",
        ]
        for m, row in modes.items():

            def ratio(k: str, row: dict[str, Any] = row) -> str:
                a, b = row.get(k), ref.get(k)
                return f"{a / b:.2f}" if isinstance(a, float) and isinstance(b, float) and b > 0 else "–"

            lines.append(
                f"| {m} | {ratio('excess_ttft_request_s')} | {ratio('common_window_ttft_mean_s')} | "
                f"{ratio('recovery_time_s')} | {ratio('ttft_mean_s')} | {ratio('tpot_mean_s')} | "
                f"{ratio('impact_ttft_mean_s')} |"
            )
    fired = [
        f"| {m} | {f['t']:.2f} | {f['mode']} | {f['target']} | {f['worker'] or '–'} | "
        f"{'ok' if f['ok'] else f['error']} |"
        for m, row in modes.items()
        for f in row.get("faults", [])
    ]
    if fired:
        lines += ["", "Faults fired (s into the load):", "", "| run | t | fault | target | worker | result |"]
        lines += ["|---|---|---|---|---|---|", *fired]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    plot_timelines(out, summary, series, failure_at, timelines)
