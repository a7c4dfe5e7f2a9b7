"""`lumen tune`: sensitivity of recovery to the dispatch threshold θ and the prefix length τ.

Every (θ, τ) cell (for each α/β pair and, optionally, the cost rule) runs the scenario with its
failures on the same workload and seed. θ, τ and the rule only act after a failure, so one
no-failure run per (α, β) serves every cell.

Cells are ranked by the mean TTFT of requests arriving in a fixed window after the failure,
[failure, failure + H] with H the median (robust, see runner.ROBUST_WINDOW_S) recovery time over the
grid (the run's end if none recovered; the median, because one cell's noisy recovery must not stretch
every cell's window): unlike the failure-impact TTFT, whose window is each cell's own recovery time, it
compares every cell over the same requests. Ties go to the shorter recovery time. The margin of the
recommendation is how much worse its θ/τ grid neighbours are (relative increase of the score): a
small margin means a flat optimum, i.e. the choice hardly matters there.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gateway.core import evaluation as ev
from gateway.core import excess as ex
from gateway.core.modes import DispatchRule, policy_for
from gateway.sim.pool import Job, run_all
from gateway.sim.result import RunResult
from gateway.sim.runner import ROBUST_SLACK, ROBUST_WINDOW_S, build_workload
from gateway.sim.scenario import Scenario


@dataclass(frozen=True, slots=True)
class Grid:
    thetas: tuple[float, ...] = (1.0, 1.5, 2.0, 3.0, 4.0)
    taus: tuple[int, ...] = (0, 128, 256, 512, 1024, 2048)
    alphas: tuple[float, ...] = (1.0,)
    betas: tuple[float, ...] = (1.0,)
    rules: tuple[str, ...] = ("threshold",)

    def __post_init__(self) -> None:
        if not (self.thetas and self.taus and self.alphas and self.betas and self.rules):
            raise ValueError("every grid axis needs at least one value")
        bad = [r for r in self.rules if r not in ("threshold", "cost")]
        if bad:
            raise ValueError(f"rules must be threshold or cost, got {bad}")

    @property
    def runs(self) -> int:
        per_ab = len(self.thetas) * len(self.taus) * ("threshold" in self.rules) + ("cost" in self.rules)
        return len(self.alphas) * len(self.betas) * (1 + per_ab)


def _score(run: RunResult, horizon: float) -> float | None:
    assert run.failure_at is not None
    end = run.failure_at + horizon
    arrival = run.arrays.arrival
    return ev.mean_present(run.arrays.metric("ttft")[(run.failure_at <= arrival) & (arrival <= end)])


def tune(
    scenario: Scenario,
    grid: Grid,
    seed: int,
    mode: str = "lumen",
    progress: Callable[[int, int, str, float], None] | None = None,
    jobs: int = 1,
) -> dict[str, Any]:
    if not scenario.failures:
        raise ValueError(f"scenario {scenario.name!r} has no failures: nothing to tune")
    start = time.perf_counter()
    base_policy = policy_for(mode)
    workload = build_workload(scenario, seed)
    # the plan: per (α, β) its no-failure twin, then a failure run per cell; run in turn or at once
    plan: list[Job] = []
    cells: list[tuple[dict[str, Any], int]] = []  # (point, the index of its twin in the plan)
    for alpha in grid.alphas:
        for beta in grid.betas:
            rec = replace(scenario.recovery, alpha=alpha, beta=beta)
            s_ab = replace(scenario, recovery=rec)
            twin_at = len(plan)
            policy = replace(base_policy, dispatch=DispatchRule.THRESHOLD)
            plan.append(Job(f"baseline α={alpha:g} β={beta:g}", s_ab, policy, failures=False))
            grid_cells: list[tuple[DispatchRule, float | None, int | None]] = []
            if "threshold" in grid.rules:
                grid_cells += [(DispatchRule.THRESHOLD, t, u) for t in grid.thetas for u in grid.taus]
            if "cost" in grid.rules:
                grid_cells.append((DispatchRule.COST, None, None))
            for rule, theta, tau in grid_cells:
                s = s_ab
                if theta is not None and tau is not None:
                    s = replace(s_ab, recovery=replace(rec, theta=theta, tau=tau))
                policy = replace(base_policy, dispatch=rule)
                plan.append(Job(f"θ={theta} τ={tau} {rule}", s, policy, failures=True))
                cells.append(({"theta": theta, "tau": tau, "alpha": alpha, "beta": beta, "rule": rule}, twin_at))
    results = run_all(plan, workload, seed, progress, jobs)
    if progress is not None:
        progress(len(plan), len(plan), "done", 0.0)
    failure_runs = [i for i, job in enumerate(plan) if job.failures]
    rows = [(point, results[i], results[at]) for (point, at), i in zip(cells, failure_runs, strict=True)]

    recoveries: list[float] = []
    for point, result, base in rows:
        assert result.failure_at is not None
        # recovery against the no-failure twin (docs/evaluation.md); the 5 s-window rule kept alongside
        twin = ex.measure(result.arrays, base.arrays, result.failure_at, "ttft")
        point["recovery_time_s"] = twin.recovery_s
        point["excess_ttft_request_s"] = twin.excess_request_s
        point["recovery_time_tpot_s"] = ex.measure(
            result.arrays, base.arrays, result.failure_at, "tpot"
        ).recovery_s
        point["recovery_time_robust_s"] = ev.windowed_recovery_time(
            result.arrays,
            base.arrays,
            result.failure_at,
            "ttft",
            window_s=ROBUST_WINDOW_S,
            slack=ROBUST_SLACK,
        )
        impact = ev.failure_impact(result.arrays, result.failure_at, point["recovery_time_s"])
        point["impact_ttft_mean_s"] = impact.mean_ttft
        point["impact_tpot_mean_s"] = impact.mean_tpot
        point["restores"], point["replays"] = result.stats.restores, result.stats.replays
        point["client_errors"] = ev.outcomes(result.arrays).errors
        rec_s = point["recovery_time_robust_s"]
        if rec_s is not None:
            recoveries.append(rec_s)
    recoveries.sort()
    # at least one window, so a cell that recovered at once still has requests to average
    horizon = max(recoveries[len(recoveries) // 2], ROBUST_WINDOW_S) if recoveries else math.inf
    for point, result, _ in rows:
        point["score_ttft_s"] = _score(result, horizon)
    points = [p for p, _, _ in rows]
    best = min((p for p in points if p["rule"] == "threshold"), key=_rank, default=None) or min(
        points, key=_rank
    )
    return {
        "scenario": scenario.name,
        "seed": seed,
        "mode": mode,
        "theta": list(grid.thetas),
        "tau": list(grid.taus),
        "alpha": list(grid.alphas),
        "beta": list(grid.betas),
        "rules": list(grid.rules),
        "horizon_s": None if math.isinf(horizon) else horizon,
        "objective": "score_ttft_s: mean TTFT of requests arriving in [failure, failure + horizon_s]",
        "grid": [p for p in points if p["rule"] == "threshold"],
        "cost_rule": [p for p in points if p["rule"] == "cost"],
        "best": best,
        "margin": margin(points, best, grid),
        "wall_s": round(time.perf_counter() - start, 2),
    }


def _rank(p: dict[str, Any]) -> tuple[float, float]:
    score = p["score_ttft_s"]
    rec = p["recovery_time_robust_s"]
    return (math.inf if score is None else score, math.inf if rec is None else rec)


def margin(points: Sequence[dict[str, Any]], best: dict[str, Any], grid: Grid) -> dict[str, Any]:
    """Relative score increase of the best cell's θ/τ neighbours (4-neighbourhood, same α/β/rule)."""
    if best["rule"] != "threshold":
        return {"min": None, "mean": None, "neighbours": []}
    same = {
        (p["theta"], p["tau"]): p
        for p in points
        if (p["alpha"], p["beta"], p["rule"]) == (best["alpha"], best["beta"], "threshold")
    }
    i, j = grid.thetas.index(best["theta"]), grid.taus.index(best["tau"])
    out = []
    for di, dj in ((-1, 0), (1, 0), (0, -1), (0, 1)):
        a, b = i + di, j + dj
        if 0 <= a < len(grid.thetas) and 0 <= b < len(grid.taus):
            n = same[(grid.thetas[a], grid.taus[b])]
            rel = None
            if n["score_ttft_s"] is not None and best["score_ttft_s"]:
                rel = n["score_ttft_s"] / best["score_ttft_s"] - 1
            out.append(
                {"theta": n["theta"], "tau": n["tau"], "score_ttft_s": n["score_ttft_s"], "worse_by": rel}
            )
    rels = [n["worse_by"] for n in out if n["worse_by"] is not None]
    return {
        "min": min(rels) if rels else None,
        "mean": sum(rels) / len(rels) if rels else None,
        "neighbours": out,
    }
