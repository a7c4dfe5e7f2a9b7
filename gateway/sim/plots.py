"""PNG figures for `lumen sim` and `lumen tune` (matplotlib, imported only when plotting)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from gateway.core.evaluation import window_means

if TYPE_CHECKING:
    from gateway.sim.runner import ScenarioReport


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _mark_failure(ax: Any, at: float | None) -> None:
    if at is not None:
        ax.axvline(at, color="red", linestyle=":", linewidth=1.2, label="failure")


def plot_report(report: ScenarioReport, out: Path, window_s: float = 2.0) -> list[Path]:
    """ttft.png and queue.png (per mode over time, failure marked; on ttft.png a dashed line in a mode's
    colour where its restarted worker serves again) and ckpt_load.png (per worker)."""
    plt = _pyplot()
    out.mkdir(parents=True, exist_ok=True)
    name = report.scenario.name
    fail = report.scenario.failure_at
    paths = []

    fig, ax = plt.subplots(figsize=(10, 4.5))
    first = next(iter(report.runs), None)
    if first is not None:
        base = report.baseline_for(first)
        m = window_means(base.arrays, "ttft", 0.0, window_s)
        ax.plot(
            np.arange(len(m)) * window_s,
            [np.nan if v is None else v for v in m],
            color="black",
            linestyle="--",
            linewidth=1,
            label="no failure",
        )
    for mode, run in report.runs.items():
        m = window_means(run.arrays, "ttft", 0.0, window_s)
        (line,) = ax.plot(
            np.arange(len(m)) * window_s, [np.nan if v is None else v for v in m], linewidth=1, label=mode
        )
        # the recovery timeline: where each restarted worker served its full model again
        for rl in run.stats.reloads:
            if rl.serving_s is not None:
                ax.axvline(rl.serving_s, color=line.get_color(), linestyle="--", linewidth=0.8, alpha=0.7)
    _mark_failure(ax, fail)
    ax.set(
        xlabel="arrival time (simulated s)",
        ylabel=f"mean TTFT per {window_s:g} s window (s)",
        title=f"{name}: TTFT over time",
        yscale="log",
    )
    ax.legend(fontsize=8, ncol=2)
    paths.append(_save(fig, out / "ttft.png", plt))

    fig, ax = plt.subplots(figsize=(10, 4.5))
    for mode, run in report.runs.items():
        ax.plot(run.sample_times, run.queue.sum(axis=1), linewidth=1, label=mode)
    _mark_failure(ax, fail)
    ax.set(
        xlabel="simulated s",
        ylabel="requests running + waiting (all workers)",
        title=f"{name}: queue depth over time",
    )
    ax.legend(fontsize=8, ncol=2)
    paths.append(_save(fig, out / "queue.png", plt))

    ckpt_modes = [m for m, r in report.runs.items() if r.ckpt_tokens.size and r.ckpt_tokens.any()]
    if ckpt_modes:
        fig, ax = plt.subplots(figsize=(10, 4.5))
        ids = report.runs[ckpt_modes[0]].worker_ids
        width = 0.8 / len(ckpt_modes)
        for i, mode in enumerate(ckpt_modes):
            run = report.runs[mode]
            before = run.sample_times < (fail if fail is not None else np.inf)
            mean = run.ckpt_tokens[before].mean(axis=0) if before.any() else run.ckpt_tokens.mean(axis=0)
            ax.bar(np.arange(len(ids)) + i * width, mean / 1e3, width, label=mode)
        ax.set_xticks(
            np.arange(len(ids)) + 0.4 - width / 2, ids, rotation=90 if len(ids) > 16 else 0, fontsize=7
        )
        ax.set(
            ylabel="checkpointed KV held (k tokens, mean before the failure)",
            title=f"{name}: per-worker checkpoint load",
        )
        ax.legend(fontsize=8)
        paths.append(_save(fig, out / "ckpt_load.png", plt))
    return paths


def plot_heatmaps(result: dict[str, Any], out: Path) -> Path:
    """heatmap.png: the score and recovery time over the (θ, τ) grid of the best α/β/rule."""
    plt = _pyplot()
    thetas, taus = result["theta"], result["tau"]
    best = result["best"]
    cells = {
        (p["theta"], p["tau"]): p
        for p in result["grid"]
        if (p["alpha"], p["beta"], p["rule"]) == (best["alpha"], best["beta"], best["rule"])
    }
    panels = [
        ("score_ttft_s", "mean TTFT after the failure (s)"),
        ("impact_ttft_mean_s", "failure-impact TTFT (s)"),
        ("recovery_time_robust_s", "recovery time, 5 s windows / 1.25x (s)"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.4))
    for ax, (key, label) in zip(axes, panels, strict=True):
        grid = np.array(
            [
                [np.nan if cells[(t, u)].get(key) is None else cells[(t, u)][key] for u in taus]
                for t in thetas
            ],
            dtype=float,
        )
        im = ax.imshow(grid, origin="lower", aspect="auto", cmap="viridis_r")
        ax.set_xticks(range(len(taus)), [str(u) for u in taus])
        ax.set_yticks(range(len(thetas)), [f"{t:g}" for t in thetas])
        ax.set(xlabel="τ (tokens)", ylabel="θ", title=label)
        mid = np.nanmean(grid) if np.isfinite(grid).any() else 0.0
        for i in range(len(thetas)):
            for j in range(len(taus)):
                if np.isfinite(grid[i, j]):
                    # viridis_r: low values are light, so they get dark text
                    color = "white" if grid[i, j] > mid else "black"
                    ax.text(j, i, f"{grid[i, j]:.3g}", ha="center", va="center", fontsize=7, color=color)
        ax.scatter(
            [taus.index(best["tau"])],
            [thetas.index(best["theta"])],
            marker="o",
            s=160,
            facecolors="none",
            edgecolors="red",
        )
        fig.colorbar(im, ax=ax)
    fig.suptitle(
        f"{result['scenario']}: θ/τ sensitivity (α={best['alpha']:g}, β={best['beta']:g}, "
        f"rule={best['rule']}); red circle = recommended"
    )
    return _save(fig, out / "heatmap.png", plt)


def _save(fig: Any, path: Path, plt: Any) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
