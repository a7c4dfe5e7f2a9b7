"""Simulator speed and output fingerprints (issue 17, item 5).

    .venv/bin/python scripts/bench_sim.py speed --scenario scale-64 --minutes 5 --mode lumen
    .venv/bin/python scripts/bench_sim.py speed --minutes 5 --mode lumen --profile /tmp/sim.prof
    .venv/bin/python scripts/bench_sim.py golden --out /tmp/sim_golden      # record fingerprints
    .venv/bin/python scripts/bench_sim.py golden --check /tmp/sim_golden    # compare against them
    .venv/bin/python scripts/bench_sim.py --native speed ...   # on the compiled modules (lumen native build)

`speed` runs one simulation of the scenario at its own (calibrated) rate for `--minutes` simulated
minutes of arrivals and prints CPU seconds (`time.process_time`, the primary figure: on a shared
machine wall time also counts other processes) and wall seconds per simulated hour of arrivals.

`golden` runs a fixed set of short (scenario, modes, seed) runs through `run_scenario` and writes, per
set, the summary (less its wall time) and a SHA-256 of every run's per-request records, samples and
statistics: two trees give the same simulator outputs exactly when their fingerprints match.
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import json
import pstats
import sys
import time
from pathlib import Path
from typing import Any

# the simulator package first: with LUMEN_SIM_NATIVE set (--native) it activates the build before
# anything imports the compiled `gateway.core` modules (gateway/sim/__init__.py)
from gateway.sim import native  # isort: split

from gateway.core.costmodel import ReloadSource
from gateway.core.modes import policy_for
from gateway.sim.result import RunResult
from gateway.sim.runner import build_workload, run_scenario, with_overrides
from gateway.sim.scenario import load_scenario
from gateway.sim.simulation import Simulation

# (name, scenario, modes, seed, duration_s, reload): short runs covering every failure kind, reload
# source, placement and dispatch rule the scenarios exercise
GOLDEN: tuple[tuple[str, str, str, int, float, str | None], ...] = (
    ("paper-4w", "paper-4w", "all", 1, 240.0, None),
    ("paper-4w-s7-peer", "paper-4w", "stop_restart,lumen,lumen-cost", 7, 200.0, "peer"),
    ("paper-8w", "paper-8w", "fixed_checkpoint,lumen", 2, 180.0, None),
    ("holder-double", "holder-double", "stop_restart,fixed_checkpoint,lumen", 1, 200.0, None),
    ("rack", "rack", "lumen,lumen-fixed-placement", 1, 180.0, None),
    ("gray", "gray", "none,lumen", 1, 180.0, None),
    ("scale-64", "scale-64", "stop_restart,lumen", 1, 120.0, None),
    ("scale-16-peer", "scale-16", "lumen,lumen-no-draft", 3, 180.0, "peer"),
)
ALL_MODES = "none,stop_restart,fixed_checkpoint,lumen,lumen-no-draft,lumen-fixed-placement,lumen-always-holder,lumen-cost"


def fingerprint(run: RunResult) -> str:
    """SHA-256 over everything a run produced (floats by their exact repr)."""
    h = hashlib.sha256()
    for r in run.records:
        h.update(repr(r).encode())  # a dataclass: every field, floats exactly
    h.update(run.sample_times.tobytes())
    h.update(run.queue.tobytes())
    h.update(run.ckpt_tokens.tobytes())
    h.update(repr(run.stats).encode())
    h.update(repr((run.failure_at, run.simulated_s)).encode())
    return h.hexdigest()


def golden_case(scenario: str, modes: str, seed: int, duration: float, reload: str | None) -> dict[str, Any]:
    source = None if reload is None else ReloadSource(reload)
    s = with_overrides(load_scenario(scenario), duration_s=duration, reload=source)
    report = run_scenario(s, (ALL_MODES if modes == "all" else modes).split(","), seed)
    summary = report.summary()
    summary.pop("wall_s")
    runs = {m: fingerprint(r) for m, r in report.runs.items()}
    bases = {f"baseline{k}": fingerprint(r) for k, r in report.baselines.items()}
    return {"summary": summary, "fingerprints": {**runs, **bases}}


def cmd_golden(args: argparse.Namespace) -> int:
    out = Path(args.check or args.out)
    out.mkdir(parents=True, exist_ok=True)
    bad = 0
    for name, scenario, modes, seed, duration, reload in GOLDEN:
        if args.only and name not in args.only.split(","):
            continue
        t0 = time.process_time()
        got = golden_case(scenario, modes, seed, duration, reload)
        cpu = time.process_time() - t0
        path = out / f"{name}.json"
        if args.check:
            want = json.loads(path.read_text())
            same = json.loads(json.dumps(got)) == want
            bad += not same
            print(f"{name:<20} {'same' if same else 'DIFFERENT'}  ({cpu:.1f} s CPU)", flush=True)
            if not same:
                for key, value in got["fingerprints"].items():
                    if want["fingerprints"].get(key) != value:
                        print(f"    run {key} differs", flush=True)
        else:
            path.write_text(json.dumps(got, indent=1, sort_keys=True))
            print(f"{name:<20} written  ({cpu:.1f} s CPU)", flush=True)
    return 1 if bad else 0


def cmd_speed(args: argparse.Namespace) -> int:
    scenario = with_overrides(load_scenario(args.scenario), duration_s=args.minutes * 60.0)
    seed = args.seed if args.seed is not None else scenario.seed
    workload = build_workload(scenario, seed)
    sim = Simulation(scenario, policy_for(args.mode), workload, seed, failures=not args.no_failures)
    horizon = scenario.workload.duration_s
    wall0, cpu0 = time.perf_counter(), time.process_time()
    last = [wall0]

    def progress(t: float) -> None:
        now = time.perf_counter()
        if now - last[0] >= 5.0:
            last[0] = now
            cpu = time.process_time() - cpu0
            print(
                f"  t={t:7.1f}/{horizon:.0f} s simulated  {cpu:6.1f} s CPU  {now - wall0:6.1f} s wall",
                flush=True,
            )

    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        profiler.enable()
    result = sim.run(progress)
    if profiler is not None:
        profiler.disable()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    per_hour = 3600.0 / horizon
    print(
        f"{scenario.name} mode={args.mode} seed={seed} rate={scenario.rate:.1f} req/s "
        f"requests={len(workload)} events={result.stats.events} simulated={horizon:.0f} s of arrivals "
        f"(run ends at {result.simulated_s:.1f} s)\n"
        f"CPU {cpu:.2f} s, wall {wall:.2f} s  ->  per simulated hour: CPU {cpu * per_hour:.1f} s, "
        f"wall {wall * per_hour:.1f} s"
        + ("  (under cProfile: inflated)" if profiler is not None else "")
        + ("  [compiled modules]" if native.active() else "  [interpreted]")
    )
    if profiler is not None:
        profiler.dump_stats(args.profile)
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(args.top)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--native",
        action="store_true",
        help="run on the compiled modules (gateway/sim/native.py; build first)",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("speed", help="CPU and wall seconds per simulated hour of one run")
    s.add_argument("--scenario", default="scale-64")
    s.add_argument("--minutes", type=float, default=5.0, help="simulated minutes of arrivals")
    s.add_argument("--mode", default="lumen")
    s.add_argument("--seed", type=int)
    s.add_argument("--no-failures", action="store_true", help="the no-failure twin instead")
    s.add_argument("--profile", metavar="FILE", help="run under cProfile, dump to FILE, print the top")
    s.add_argument("--top", type=int, default=30)
    s.set_defaults(func=cmd_speed)
    g = sub.add_parser("golden", help="record or check output fingerprints of fixed short runs")
    g.add_argument("--out", default="/tmp/sim_golden")
    g.add_argument("--check", metavar="DIR", help="compare against the fingerprints in DIR")
    g.add_argument("--only", help="comma-separated case names")
    g.set_defaults(func=cmd_golden)
    args = p.parse_args(argv)
    if args.native and not native.active():
        lib = native.ready()
        if lib is None:
            print(f"--native: {native.status()}", file=sys.stderr)
            return 2
        native.restart(lib, sys.argv if argv is None else [sys.argv[0], *argv])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
