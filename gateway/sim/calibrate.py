"""Calibrating a trace: the speedup whose no-failure mean TTFT (mode stop_restart) is a target, as
EVALUATION's scenarios ask ("rate set so the no-failure mean TTFT is about 1.2 s"); a synthetic
workload's rate is `runner.calibrate_rate`. The trace stays the trace: only its time axis is compressed."""

from __future__ import annotations

from dataclasses import replace

from gateway.sim.runner import no_failure_ttft
from gateway.sim.scenario import Scenario


def calibrate_speedup(
    scenario: Scenario, target_ttft_s: float, seed: int, iters: int = 12, max_speedup: float = 1024.0
) -> tuple[float, float]:
    """The speedup of the scenario's TRACE whose no-failure mean TTFT (stop_restart) is closest to the
    target: doubling from 1 (or halving) until the target is bracketed, then bisection.

    Returns (speedup, its mean TTFT). The trace stays the trace: only its time axis is compressed."""
    if scenario.workload.source != "trace":
        raise ValueError("calibrate_speedup needs a trace workload")

    def ttft(speedup: float) -> float:
        return no_failure_ttft(
            replace(scenario, workload=replace(scenario.workload, trace_speedup=speedup)), seed
        )

    lo = hi = 1.0
    value = ttft(1.0)
    best = (1.0, value)
    if value < target_ttft_s:
        while value < target_ttft_s and hi < max_speedup:
            lo, hi = hi, hi * 2
            value = ttft(hi)
            best = min(best, (hi, value), key=lambda b: abs(b[1] - target_ttft_s))
    else:
        while value >= target_ttft_s and lo > 1 / max_speedup:
            lo, hi = lo / 2, lo
            value = ttft(lo)
            best = min(best, (lo, value), key=lambda b: abs(b[1] - target_ttft_s))
    for _ in range(iters):
        mid = (lo * hi) ** 0.5
        value = ttft(mid)
        if abs(value - target_ttft_s) < abs(best[1] - target_ttft_s):
            best = (mid, value)
        lo, hi = (mid, hi) if value < target_ttft_s else (lo, mid)
    return best
