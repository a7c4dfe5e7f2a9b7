"""The overhead bench's plot: achieved rate and TTFT p99 against the offered rate, one line per path,
sustained steps filled. Optional: matplotlib is imported only when plotting, and without it nothing is
drawn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from loadtests.bench_smg.report import label, sustained

STYLE = {"direct": ":", "direct_oai": ":", "smg": "--", "smg_gen": "--"}


def plot_rates(report: dict[str, Any], path: Path) -> bool:
    """Write the PNG; False (nothing written) without matplotlib or rows."""
    if not report.get("rows") or not report.get("targets"):
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional
        return False
    rows, bound = report["rows"], report["args"]["ttft_bound_ms"]
    rates = [float(r) for r in report["args"]["rates"].split(",")]
    fig, (ax_rate, ax_ttft) = plt.subplots(1, 2, figsize=(13, 5))
    for t in report["targets"]:
        name = t["name"]
        pts = [rows[f"{name}@{r:g}"] for r in rates]
        ys = [p["achieved_rps"] / p["offered_rps"] if p["offered_rps"] else 0.0 for p in pts]
        p99 = [p["ttft_p99_ms"] for p in pts]
        style = STYLE.get(name, "-")
        (line,) = ax_rate.plot(rates, ys, style, marker="o", mfc="none", label=label(name, report))
        ax_ttft.plot(rates, [v if v is not None else float("nan") for v in p99], style, marker="o",
                     mfc="none", color=line.get_color(), label=label(name, report))  # fmt: skip
        ok = [i for i, p in enumerate(pts) if sustained(p, bound)]
        ax_rate.plot([rates[i] for i in ok], [ys[i] for i in ok], "o", color=line.get_color())
        ax_ttft.plot([rates[i] for i in ok], [p99[i] for i in ok], "o", color=line.get_color())
    ax_rate.axhline(0.95, color="grey", lw=0.8)
    ax_rate.set_xlabel("offered req/s")
    ax_rate.set_ylabel("achieved / offered")
    ax_rate.set_title("achieved rate (filled: sustained)")
    ax_ttft.axhline(bound, color="grey", lw=0.8)
    ax_ttft.set_yscale("log")
    ax_ttft.set_xlabel("offered req/s")
    ax_ttft.set_ylabel("TTFT p99 (ms)")
    ax_ttft.set_title(f"TTFT p99 (bound {bound:g} ms)")
    ax_ttft.legend(fontsize=8)
    fig.suptitle(f"{report.get('command', '')}\n{report.get('machine', '')}, commit {report.get('commit', '')}",
                 fontsize=8)  # fmt: skip
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
