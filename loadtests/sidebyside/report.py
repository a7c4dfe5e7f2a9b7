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
    cols = [
        "ttft_mean_s",
        "tpot_mean_s",
        "recovery_time_s",
        "excess_ttft_request_s",
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
    ref = modes.get("stop_restart")
    if ref:
        lines += [
            "",
            "Ratios to stop_restart (lower is better):",
            "",
            "| mode | TTFT | TPOT | recovery | excess request-s | impact TTFT |",
            "|---|---|---|---|---|---|",
        ]
        for m, row in modes.items():

            def ratio(k: str, row: dict[str, Any] = row) -> str:
                a, b = row.get(k), ref.get(k)
                return f"{a / b:.2f}" if isinstance(a, float) and isinstance(b, float) and b > 0 else "–"

            lines.append(
                f"| {m} | {ratio('ttft_mean_s')} | {ratio('tpot_mean_s')} | {ratio('recovery_time_s')} | "
                f"{ratio('excess_ttft_request_s')} | {ratio('impact_ttft_mean_s')} |"
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
