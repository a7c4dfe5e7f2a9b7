"""The side-by-side plots: timeline.png (TTFT, TPOT and queued requests over time, faults and recovery
marked) and queues-MODE.png (per-worker queues of a faulted run). Optional: matplotlib is imported
only when plotting, and without it nothing is drawn."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from gateway.core import evaluation as ev
from loadtests.faults import parse_fault


def plot_timelines(
    out: Path,
    summary: dict[str, Any],
    series: dict[str, list[ev.RequestRecord]],
    failure_at: float,
    timelines: dict[str, dict[str, Any]],
) -> None:
    """timeline.png for all runs, and queues-MODE.png for every faulted run with polled queues."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional
        return
    schedule = [parse_fault(s) for s in summary.get("faults", [])]
    fig, axes = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    colors: dict[str, str] = {}
    for name, recs in series.items():
        metrics: tuple[ev.Metric, ...] = ("ttft", "tpot")
        for ax, metric in zip(axes[:2], metrics, strict=True):
            w = ev.window_means(recs, metric)
            pts = [(2.0 * k + 1.0, v) for k, v in enumerate(w) if v is not None]
            (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=name)
            colors[name] = line.get_color()
        samples = timelines.get(name, {}).get("queue", [])
        if samples:
            waiting = [sum(_queue(w, "waiting") for w in s["workers"].values()) for s in samples]
            axes[2].plot([s["t"] for s in samples], waiting, color=colors[name], label=name)
    for ax in axes:
        _mark_faults(ax, [(e.at, str(e)) for e in schedule], failure_at)
    for name, tl in timelines.items():
        rec = tl.get("recovery_time_s")
        if rec is not None:
            for ax in axes:
                ax.axvline(tl["failure_at"] + rec, color=colors.get(name, "green"), linestyle=":", lw=1.5)
            axes[0].text(
                tl["failure_at"] + rec,
                0.02,
                f" recovered ({name})",
                rotation=90,
                fontsize=7,
                color=colors.get(name, "green"),
                transform=axes[0].get_xaxis_transform(),
                va="bottom",
            )
    axes[0].set_ylabel("mean TTFT of 2 s window (s)")
    axes[0].set_yscale("log")
    axes[1].set_ylabel("mean TPOT of 2 s window (s)")
    axes[1].set_yscale("log")
    axes[2].set_ylabel("queued requests (all workers)")
    axes[2].set_xlabel("request arrival / poll time (s into the load)")
    axes[0].legend(fontsize=8)
    axes[0].set_title("Live side-by-side: TTFT, TPOT and queues over time (faults red, recovery dotted)")
    fig.tight_layout()
    fig.savefig(out / "timeline.png", dpi=110)
    plt.close(fig)
    for name, tl in timelines.items():
        if tl.get("faults") and tl.get("queue"):
            _plot_queues(plt, out / f"queues-{name}.png", name, tl)


def _queue(w: dict[str, Any], key: str) -> float:
    """A worker's polled count; NaN (a gap) once it failed, its last heartbeat's numbers are stale."""
    if w.get("state") in ("FAILED", "REMOVED"):
        return math.nan
    return float(w.get(key) or 0)


def _mark_faults(ax: Any, marks: list[tuple[float, str]], fallback_at: float) -> None:
    """Red vertical lines, one per instant, labelled with what struck then."""
    by_t: dict[float, list[str]] = {}
    for t, label in marks or [(fallback_at, "fault")]:
        by_t.setdefault(round(t, 2), []).append(label)
    for t, labels in by_t.items():
        ax.axvline(t, color="red", linestyle="--", lw=1)
        ax.text(
            t,
            0.98,
            " " + ", ".join(labels),
            rotation=90,
            fontsize=7,
            color="red",
            transform=ax.get_xaxis_transform(),
            va="top",
        )


def _plot_queues(plt: Any, path: Path, name: str, tl: dict[str, Any]) -> None:
    samples = tl["queue"]
    ids = sorted({wid for s in samples for wid in s["workers"]}, key=lambda w: (len(w), w))
    fig, axes = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    ts = [s["t"] for s in samples]
    for wid in ids:
        for ax, key in zip(axes, ("running", "waiting"), strict=True):
            ys = [_queue(s["workers"][wid], key) if wid in s["workers"] else math.nan for s in samples]
            ax.plot(ts, ys, label=wid, lw=1.2)
    marks = [
        (f["t"], f"{f['mode']} {f['worker']}" + (f" ({f['target']})" if f["target"] != f["worker"] else ""))
        for f in tl["faults"]
        if f["ok"]
    ]
    for ax in axes:
        _mark_faults(ax, marks, tl.get("failure_at", 0.0))
        rec = tl.get("recovery_time_s")
        if rec is not None:
            ax.axvline(tl["failure_at"] + rec, color="green", linestyle=":", lw=1.5, label="recovered")
    axes[0].set_ylabel("running requests")
    axes[1].set_ylabel("waiting requests")
    axes[1].set_xlabel("s into the load (/admin/workers polled)")
    axes[0].legend(fontsize=8, ncol=min(len(ids) + 1, 8))
    axes[0].set_title(f"{name}: per-worker queues (faults red, recovery dotted green)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
