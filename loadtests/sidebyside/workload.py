"""The requests of a side-by-side run: the conv-like generator, or a trace (`--trace FILE` with
`--speedup X`, `--rate R` as a speedup, or `--calibrate-ttft T`), lengths scaled by `--scale` to fit a
CPU box, and a description of what ran for the report.

`--calibrate-ttft T` on a trace picks the speedup in the simulator, on a mirror of the live cluster
(workers, model, batch limit, the scaled lengths; the engine's modelled time stretched by
`--time-scale`), so that the no-failure mean TTFT is T wall seconds. The live gateway's own CPU time
is not modelled: the report gives the target and the live no-failure TTFT measured beside it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from gateway.core import evaluation as ev
from gateway.core.modes import policy_for
from gateway.sim.scenario import parse_scenario
from gateway.sim.simulation import Simulation
from gateway.sim.workload import Workload, describe_synthetic, describe_trace, rate_of, read_trace, synthetic

DEFAULT_RATE = 6.0  # requests per second of the conv-like generator when --rate is not given


class LoadError(ValueError):
    """Flags that do not make a workload (the message names them)."""


@dataclass(frozen=True, slots=True)
class Shape:
    at: float  # seconds after the load starts
    prompt_tokens: int
    output_tokens: int


def scaled(wl: Workload, scale: float) -> Workload:
    """The workload with its lengths multiplied by `scale` (prompts >= 8, outputs >= 4 tokens)."""
    prompts = np.maximum(8, (wl.prompts * scale).astype(np.int64))
    outputs = np.maximum(4, (wl.outputs * scale).astype(np.int64))
    return Workload(wl.arrivals, prompts, outputs)


def shapes_of(wl: Workload) -> list[Shape]:
    return [
        Shape(float(t), int(p), int(o)) for t, p, o in zip(wl.arrivals, wl.prompts, wl.outputs, strict=True)
    ]


def conv_like(duration_s: float, rate: float, seed: int, scale: float) -> list[Shape]:
    """Poisson arrivals with the Azure-conv length fit the simulator uses (`gateway.sim.workload`),
    lengths multiplied by `scale` to fit a CPU box."""
    return shapes_of(scaled(synthetic(np.random.default_rng(seed), rate, duration_s), scale))


def build_load(args: argparse.Namespace) -> tuple[list[Shape], dict[str, Any]]:
    """The run's requests and their description (summary.json's `workload`).

    Raises LoadError for flags that conflict, TraceError for a trace that cannot be read."""
    trace: Path | None = args.trace
    if trace is None:
        for flag, value in (("--speedup", args.speedup), ("--calibrate-ttft", args.calibrate_ttft)):
            if value is not None:
                raise LoadError(f"{flag} needs --trace FILE (the synthetic workload takes --rate)")
        rate = DEFAULT_RATE if args.rate is None else args.rate
        wl = scaled(synthetic(np.random.default_rng(args.seed), rate, args.duration), args.scale)
        return shapes_of(wl), {**describe_synthetic("conv", rate, 1.0, wl), "length_scale": args.scale}
    given = [
        f
        for f, v in (
            ("--speedup", args.speedup),
            ("--rate", args.rate),
            ("--calibrate-ttft", args.calibrate_ttft),
        )
        if v is not None
    ]
    if len(given) > 1:
        raise LoadError(
            f"give one of --speedup, --rate, --calibrate-ttft with --trace, got {', '.join(given)}"
        )
    for flag in given:
        value = getattr(args, flag[2:].replace("-", "_"))
        if not value > 0:
            raise LoadError(f"{flag} must be > 0, got {value}")
    extra: dict[str, Any] = {"length_scale": args.scale}
    if args.calibrate_ttft is not None:
        speedup, modelled = calibrate_live_speedup(args, trace)
        extra.update(calibrated_ttft_s=args.calibrate_ttft, calibration_sim_ttft_s=round(modelled, 4))
        extra["calibration"] = (
            "speedup chosen in the simulator on a mirror of this cluster; the gateway's own CPU time "
            "is not modelled"
        )
    elif args.rate is not None:
        native = rate_of(read_trace(trace, 1.0))
        if not native > 0:
            raise LoadError(f"{trace}: --rate needs a trace with two or more distinct arrival times")
        speedup = args.rate / native
        extra["speedup_from_rate_rps"] = args.rate
    else:
        speedup = 1.0 if args.speedup is None else args.speedup
    wl = scaled(read_trace(trace, speedup).head(args.duration), args.scale)
    if not len(wl):
        raise LoadError(
            f"{trace}: no request arrives in the first {args.duration:g} s at speedup {speedup:g}"
        )
    return shapes_of(wl), {**describe_trace(trace, speedup, wl), **extra}


def calibrate_live_speedup(args: argparse.Namespace, trace: Path, iters: int = 10) -> tuple[float, float]:
    """(live speedup, the simulator's no-failure mean TTFT in wall seconds) for --calibrate-ttft.

    In the simulator's modelled time the live run is `time_scale` times faster: arrivals come at
    speedup × time_scale and the target TTFT is T / time_scale."""
    ts = args.time_scale
    scenario = parse_scenario(
        {
            "cluster": {
                "workers": args.workers,
                "model": args.model,
                "max_running_requests": args.max_running,
            },
            "workload": {"source": "trace", "trace": str(trace), "duration_s": args.duration / ts},
        },
        name="live-mirror",
    )
    policy = policy_for("stop_restart")
    raw = read_trace(trace, 1.0)
    target = args.calibrate_ttft / ts

    def ttft(sim_speedup: float) -> float:
        wl = Workload(raw.arrivals / sim_speedup, raw.prompts, raw.outputs).head(args.duration / ts)
        s = replace(scenario, failures=())
        value = ev.mean_metric(
            Simulation(s, policy, scaled(wl, args.scale), args.seed, failures=False).run().records, "ttft"
        )
        return float("inf") if value is None else value

    lo = hi = ts  # live speedup 1
    value = ttft(hi)
    best = (hi, value)
    if value < target:  # bracket the target: double (or halve) the speedup until it is crossed
        while value < target and hi < 1024 * ts:
            lo, hi = hi, hi * 2
            value = ttft(hi)
            best = min(best, (hi, value), key=lambda b: abs(b[1] - target))
    else:
        while value >= target and lo > ts / 1024:
            lo, hi = lo / 2, lo
            value = ttft(lo)
            best = min(best, (lo, value), key=lambda b: abs(b[1] - target))
    for _ in range(iters):
        mid = (lo * hi) ** 0.5
        value = ttft(mid)
        if abs(value - target) < abs(best[1] - target):
            best = (mid, value)
        lo, hi = (mid, hi) if value < target else (lo, mid)
    return best[0] / ts, best[1] * ts
