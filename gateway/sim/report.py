"""summary.json and summary.md for `lumen sim`: per-mode metrics and ratios to the baselines."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gateway.core.excess import RecoveryParams
from gateway.sim.workload import workload_label

_P = RecoveryParams()  # the measure's defaults, named in the table's legend

# the columns of the Markdown table: (key, header, format)
COLUMNS = (
    ("ttft_mean_s", "TTFT s", "{:.3f}"),
    ("tpot_mean_s", "TPOT s", "{:.4f}"),
    ("recovery_time_s", "recovery s", "{:.1f}"),
    ("recovery_time_tpot_s", "recovery (TPOT) s", "{:.1f}"),
    ("excess_ttft_request_s", "excess TTFT req·s", "{:.0f}"),
    ("impact_ttft_mean_s", "impact TTFT s", "{:.3f}"),
    ("impact_tpot_mean_s", "impact TPOT s", "{:.4f}"),
    ("recovery_time_windowed_s", "recovery 2s/1.1x s", "{:.0f}"),
    ("recovery_time_robust_s", "recovery 5s/1.25x s", "{:.0f}"),
    ("impact_ttft_robust_s", "impact TTFT 5s/1.25x s", "{:.3f}"),
    ("impact_ttft_x_baseline", "x no-failure", "{:.2f}"),
    ("ttft_after_failure_s", "TTFT common window s", "{:.3f}"),
    ("ttft_after_failure_x_baseline", "x no-failure (common)", "{:.2f}"),
    ("reload_source", "reload", "{}"),
    ("reload_s", "reload s", "{:.1f}"),
    ("outage_boost", "boost", "{:.2f}"),
    ("client_errors", "errors", "{}"),
    ("interrupted", "interrupted", "{}"),
    ("restores", "restores", "{}"),
    ("replays", "replays", "{}"),
    ("checkpoint_coverage", "coverage", "{:.2f}"),
    ("holder_balance", "holder balance", "{:.2f}"),
    ("acceptance_rate", "a", "{:.2f}"),
    ("draft_k_mean", "k", "{:.1f}"),
)
RATIO_KEYS = (
    ("ttft_mean_s", "TTFT"),
    ("tpot_mean_s", "TPOT"),
    ("recovery_time_s", "recovery"),
    ("excess_ttft_request_s", "excess TTFT req·s"),
    ("impact_ttft_mean_s", "impact TTFT"),
    ("impact_tpot_mean_s", "impact TPOT"),
    ("recovery_time_robust_s", "recovery 5s/1.25x"),
    ("impact_ttft_robust_s", "impact TTFT 5s/1.25x"),
    ("ttft_after_failure_s", "TTFT common window"),
)
REFERENCES = ("stop_restart", "fixed_checkpoint")


def _cell(value: Any, fmt: str) -> str:
    if value is None:
        return "–"
    return value if isinstance(value, str) else fmt.format(value)


def change(value: Any, ref: Any) -> str:
    """Relative change in percent ('–' when either side is missing, 'never' for no recovery)."""
    if value is None or ref is None:
        return "–"
    if ref == 0:
        return "±0%" if value == 0 else "–"
    return f"{(value / ref - 1) * 100:+.1f}%"


def markdown(summary: dict[str, Any]) -> str:
    modes: dict[str, dict[str, Any]] = summary["modes"]
    lines = [
        f"# {summary['scenario']}: {summary['workers']} workers, {summary['model']} on {summary['gpu']}",
        "",
        f"seed {summary['seed']}, {summary['requests']} requests over {summary['duration_s']:g} s"
        + (f" at {summary['rate_rps']} req/s" if summary.get("rate_rps") else "")
        + (f", failure at {summary['failure_at_s']:g} s" if summary.get("failure_at_s") is not None else "")
        + (f", restarts reload from {summary['reload']}" if summary.get("reload") else "")
        + f"; simulated (virtual) time, {summary['runs']} runs in {summary['wall_s']:.1f} s wall.",
        "",
        f"Workload: {workload_label(summary['workload'])}." if summary.get("workload") else "",
        "",
        "| mode | " + " | ".join(h for _, h, _ in COLUMNS) + " |",
        "|---|" + "---:|" * len(COLUMNS),
    ]
    for name, m in modes.items():
        lines.append(f"| {name} | " + " | ".join(_cell(m.get(k), f) for k, _, f in COLUMNS) + " |")
    base = next(iter(modes.values()), {})
    lines += [
        "",
        f"No-failure run: TTFT {_cell(base.get('baseline_ttft_mean_s'), '{:.3f}')} s, "
        f"TPOT {_cell(base.get('baseline_tpot_mean_s'), '{:.4f}')} s "
        "(recovery is measured against it; '–' recovery: not recovered by the end of the run). "
        "Recovery is docs/evaluation.md's: from the failure until the per-request excess TTFT over "
        f"the no-failure twin (same requests), as a centred {_P.smooth_s:g} s rolling median, stays "
        f"within {_P.bound_rel:.0%} of the twin's TTFT (at least {_P.floor_ttft_s * 1000:g} ms) for "
        f"{_P.sustain_s:g} s; 'excess TTFT req·s' sums that excess over every "
        "request (the failure's damage); impact columns average the requests arriving between the "
        "failure and the recovery. The 2s/1.1x and 5s/1.25x columns are EVALUATION's original windowed "
        "rule, for comparison; 'x no-failure' divides the 5s/1.25x impact TTFT "
        "by the no-failure run's mean TTFT over the same arrival window. 'common window': mean TTFT of "
        "requests arriving in [failure, failure + H], H = the median of the modes' 5s/1.25x recovery "
        f"times ({_cell(base.get('window_s'), '{:.0f}')} s), the same requests for every mode.",
    ]
    if "bound" in modes:
        lines += [
            "",
            "'bound' is no mode but the capacity bound (docs/evaluation.md): lumen with each kill's "
            "capacity loss only, nothing else lost and no detection delay, the same reload; the "
            "distance of a mode from it is what a better checkpoint, restore or detection could win.",
        ]
    for ref in REFERENCES:
        if ref not in modes:
            continue
        lines += [
            "",
            f"Change vs `{ref}`:",
            "",
            "| mode | " + " | ".join(h for _, h in RATIO_KEYS) + " |",
            "|---|" + "---:|" * len(RATIO_KEYS),
        ]
        for name, m in modes.items():
            if name == ref:
                continue
            cells = [change(m.get(k), modes[ref].get(k)) for k, _ in RATIO_KEYS]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_summary(out: Path, summary: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, allow_nan=False) + "\n")
    (out / "summary.md").write_text(markdown(summary))
