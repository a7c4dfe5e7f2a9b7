"""`lumen sim`, `lumen tune` and `lumen native`: the discrete-event simulator's command line."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from gateway.core.costmodel import RELOAD_SOURCES, ReloadSource
from gateway.core.modes import EVALUATION_MODES, MODES
from gateway.sim.scenario import ScenarioError, load_scenario, scenario_names


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {unknown}; known: {', '.join(MODES)}")
    return modes


def _jobs(text: str) -> int:
    try:
        n = int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a whole number of runs, got {text!r}") from exc
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0: one per CPU for large runs), got {n}")
    return n


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--scenario",
        required=True,
        help=f"name in configs/scenarios ({', '.join(scenario_names())}) or a path",
    )
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--seed", type=int, help="random seed (default: the scenario's)")
    p.add_argument(
        "--duration", type=float, help="workload duration in simulated seconds (default: the scenario's)"
    )
    p.add_argument(
        "--rate",
        type=float,
        help="total arrival rate in requests/s (default: the scenario's); on a trace it sets the speedup "
        "so that the trace's mean rate becomes this",
    )
    p.add_argument(
        "--trace",
        type=Path,
        metavar="FILE",
        help="replay this CSV (TIMESTAMP, ContextTokens, GeneratedTokens) instead of the scenario's workload",
    )
    p.add_argument(
        "--speedup", type=float, metavar="X", help="replay the trace X times faster (default: the scenario's)"
    )
    p.add_argument(
        "--reload",
        choices=RELOAD_SOURCES,
        help="where a restart's full weights come from: disk, or a seed survivor (default: the scenario's)",
    )
    p.add_argument(
        "--jobs",
        type=_jobs,
        default=0,
        metavar="N",
        help="runs at once, each in its own process (default 0: one per CPU when each run has 20,000 "
        "requests or more, else in turn; 1: in turn, in this process); the results are the same, each "
        "process holds one run in memory",
    )
    p.add_argument(
        "--native",
        choices=("auto", "on", "off"),
        default="auto",
        help="run the simulator's compiled modules (gateway/sim/native.py; the same results, ~3x less "
        "CPU): auto (default) when `lumen native build` has built them for these sources, on: build "
        "them first if need be, off: interpreted",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG figures")


def add_sim_commands(sub: Any) -> None:
    """Register `sim` and `tune` on the `lumen` parser."""
    p = sub.add_parser("sim", help="simulate a scenario in every recovery mode (virtual time)")
    _common(p)
    p.add_argument("--modes", type=_modes, default=EVALUATION_MODES, help="comma-separated recovery modes")
    p.add_argument(
        "--calibrate-ttft",
        type=float,
        metavar="S",
        help="instead of a run: find the arrival rate (synthetic) or the trace's speedup (--trace) whose "
        "no-failure mean TTFT is S seconds",
    )
    p.add_argument(
        "--bound",
        action="store_true",
        help="also run the capacity bound, a row 'bound': lumen with the failure's capacity loss only "
        "(no work lost, no detection delay), what no recovery can beat with the same reload",
    )
    p.set_defaults(func=cmd_sim)

    p = sub.add_parser("tune", help="θ/τ (and α/β, dispatch rule) sensitivity grid on a scenario")
    _common(p)
    p.add_argument("--theta", type=_floats, default=(1.0, 1.5, 2.0, 3.0, 4.0))
    p.add_argument("--tau", type=_ints, default=(0, 128, 256, 512, 1024, 2048))
    p.add_argument("--alpha", type=_floats, default=(1.0,))
    p.add_argument("--beta", type=_floats, default=(1.0,))
    p.add_argument("--rules", default="threshold", help="comma-separated: threshold, cost")
    p.add_argument("--mode", default="lumen", choices=[m for m in MODES if MODES[m].checkpointing])
    p.add_argument(
        "--current",
        metavar="THETA,TAU",
        help="the θ and τ in force today (default: the scenario's, which are the gateway's defaults); "
        "shown beside the recommendation and always in the grid",
    )
    p.add_argument(
        "--port", type=int, default=8000, help="the gateway port the printed `lumen cluster config set` names"
    )
    p.add_argument(
        "--fail-at",
        type=float,
        metavar="S",
        help="move the scenario's failures so the first strikes S seconds into the workload (a recorded "
        "trace shorter than the scenario's failure time needs it)",
    )
    p.set_defaults(func=cmd_tune)

    p = sub.add_parser("native", help="compile the simulator's hot modules with mypyc (build, status, clean)")
    p.add_argument("action", choices=("build", "status", "clean"))
    p.add_argument("--force", action="store_true", help="build even if a build for these sources exists")
    p.set_defaults(func=cmd_native)


def cmd_native(args: argparse.Namespace) -> int:
    from gateway.sim import native

    if args.action == "status":
        print(native.status())
        return 0
    if args.action == "clean":
        print(f"removed {native.clean()} build(s) of other sources from {native.cache_root()}")
        return 0
    try:
        lib = native.build(
            progress=lambda line: print(f"lumen native: {line}", file=sys.stderr), force=args.force
        )
    except native.NativeError as exc:
        print(f"lumen native: {exc}", file=sys.stderr)
        return 2
    print(lib)
    return 0


def _native(args: argparse.Namespace) -> None:
    """`--native`: run this command on the compiled modules, by starting it again in a process that
    loads them (gateway/sim/native.py); returns when it runs interpreted. A command called as a
    function (`main([...])`, not from the command line) is never restarted."""
    from gateway.sim import native

    def say(line: str) -> None:
        if not args.quiet:
            print(f"lumen: {line}", file=sys.stderr)

    if native.active():
        say("running the simulator's compiled modules (lumen native status)")
        return
    if args.native == "off":
        return
    lib = native.ready()
    if lib is None and args.native == "on":
        try:
            lib = native.build(progress=lambda line: print(f"lumen native: {line}", file=sys.stderr))
        except native.NativeError as exc:
            print(f"lumen: --native on: {exc}", file=sys.stderr)
            raise SystemExit(2) from exc
    command_line = getattr(args, "command_line", None)
    if lib is None or command_line is None:
        if lib is None:
            say("the simulator runs interpreted (`lumen native build` compiles it once: ~3x less CPU)")
        return
    native.restart(lib, [*native.LUMEN, *command_line])


def _scenario(args: argparse.Namespace) -> Any:
    from gateway.sim.runner import with_overrides

    try:
        scenario = load_scenario(args.scenario)
    except ScenarioError as exc:
        print(f"lumen: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    for flag, value in (("--duration", args.duration), ("--rate", args.rate), ("--speedup", args.speedup)):
        if value is not None and not value > 0:
            print(f"lumen: {flag} must be > 0", file=sys.stderr)
            raise SystemExit(2)
    reload = None if args.reload is None else ReloadSource(args.reload)
    try:
        return with_overrides(scenario, args.duration, args.rate, reload, args.trace, args.speedup)
    except ValueError as exc:  # TraceError included: it names the file and line
        print(f"lumen: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc


def _plots(fn: Any, *a: Any) -> None:
    try:
        fn(*a)
    except ImportError:
        print(
            "lumen: matplotlib is not installed; skipping plots (pip install lumen[plots])", file=sys.stderr
        )


def cmd_sim(args: argparse.Namespace) -> int:
    from gateway.sim.plots import plot_report
    from gateway.sim.progress import ProgressBar
    from gateway.sim.report import markdown, write_summary
    from gateway.sim.runner import run_scenario
    from gateway.sim.workload import TraceError

    _native(args)
    scenario = _scenario(args)
    seed = scenario.seed if args.seed is None else args.seed
    if args.calibrate_ttft is not None:
        return _calibrate(scenario, args.calibrate_ttft, seed)
    bar = None if args.quiet else ProgressBar(scenario.workload.duration_s)
    try:
        report = run_scenario(scenario, args.modes, seed, progress=bar, bound=args.bound, jobs=args.jobs)
    except TraceError as exc:
        print(f"lumen: {exc}", file=sys.stderr)
        return 2
    summary = report.summary()
    if "warning" in summary["workload"]:
        print(f"lumen: WARNING: {summary['workload']['warning']}", file=sys.stderr)
    write_summary(args.out, summary)
    if not args.no_plots:
        _plots(plot_report, report, args.out)
    print(markdown(summary))
    print(f"wrote {args.out / 'summary.json'}", file=sys.stderr)
    return 0


def _calibrate(scenario: Any, target_ttft_s: float, seed: int) -> int:
    """`lumen sim --calibrate-ttft S`: print the rate (synthetic) or the trace speedup that gives a
    no-failure mean TTFT of S seconds; a trace stays the trace."""
    from gateway.sim.calibrate import calibrate_speedup
    from gateway.sim.runner import calibrate_rate, resolve_workload
    from gateway.sim.workload import TraceError

    if not target_ttft_s > 0:
        print("lumen: --calibrate-ttft must be > 0", file=sys.stderr)
        return 2
    try:
        if scenario.workload.source == "trace":
            speedup, ttft = calibrate_speedup(scenario, target_ttft_s, seed)
            scenario = replace(scenario, workload=replace(scenario.workload, trace_speedup=speedup))
            out: dict[str, Any] = {"scenario": scenario.name, "speedup": round(speedup, 4)}
        else:
            rate, ttft = calibrate_rate(scenario, target_ttft_s, seed)
            out = {
                "scenario": scenario.name,
                "rate_rps": round(rate, 3),
                "rate_per_worker": round(rate / scenario.cluster.workers, 4),
            }
            scenario = replace(scenario, workload=replace(scenario.workload, rate=rate, rate_per_worker=0.0))
        out["ttft_mean_s"] = ttft
        out["workload"] = resolve_workload(scenario, seed)[1]
    except TraceError as exc:
        print(f"lumen: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(out))
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    from gateway.sim.plots import plot_heatmaps
    from gateway.sim.progress import ProgressBar
    from gateway.sim.tuning import Grid, tune
    from gateway.sim.workload import TraceError

    _native(args)
    scenario = _scenario(args)
    if args.fail_at is not None and scenario.failures:
        if not args.fail_at >= 0:
            print("lumen: --fail-at must be >= 0", file=sys.stderr)
            return 2
        shift = args.fail_at - min(f.at_s for f in scenario.failures)
        failures = tuple(replace(f, at_s=f.at_s + shift) for f in scenario.failures)
        scenario = replace(scenario, failures=failures)
    seed = scenario.seed if args.seed is None else args.seed
    try:
        now_theta, now_tau = scenario.recovery.theta, scenario.recovery.tau
        if args.current:
            a, _, b = args.current.partition(",")
            now_theta, now_tau = float(a), int(b)
        # today's values are always a cell, so they can be shown beside the recommendation
        thetas = tuple(sorted({*args.theta, now_theta}))
        taus = tuple(sorted({*args.tau, now_tau}))
        grid = Grid(thetas, taus, args.alpha, args.beta, tuple(r.strip() for r in args.rules.split(",")))
    except ValueError as exc:
        print(f"lumen: {exc}", file=sys.stderr)
        return 2
    bar = None if args.quiet else ProgressBar(scenario.workload.duration_s)
    try:
        result = tune(scenario, grid, seed, args.mode, progress=bar, jobs=args.jobs)
    except TraceError as exc:
        print(f"lumen: {exc}", file=sys.stderr)
        return 2
    today = next(
        (
            p
            for p in result["grid"]
            if p["theta"] == now_theta
            and p["tau"] == now_tau
            and p["alpha"] == args.alpha[0]
            and p["beta"] == args.beta[0]
        ),
        None,
    )
    result["today"] = today
    best = result["best"]
    result["apply"] = (
        f"lumen cluster config set recovery.theta={best['theta']} recovery.tau={best['tau']} --port {args.port}"
        if best.get("rule") == "threshold"
        else None
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tune.json").write_text(json.dumps(result, indent=2) + "\n")
    if not args.no_plots:
        _plots(plot_heatmaps, result, args.out)
    best, m = result["best"], result["margin"]
    worse = "–" if m["min"] is None else f"{m['min'] * 100:+.1f}% (min), {m['mean'] * 100:+.1f}% (mean)"
    print(
        f"recommended: theta={best['theta']} tau={best['tau']} alpha={best['alpha']} beta={best['beta']} "
        f"rule={best['rule']}: TTFT after failure {best['score_ttft_s']} s, recovery "
        f"{best['recovery_time_robust_s']} s (5 s windows, 1.25x); neighbours worse by {worse}"
    )
    print(side_by_side(best, today))
    if result["apply"]:
        print(f"apply it live: {result['apply']}")
    print(f"wrote {args.out / 'tune.json'}", file=sys.stderr)
    return 0


def side_by_side(best: dict[str, Any], today: dict[str, Any] | None) -> str:
    """The recommendation beside today's values: the damage (excess TTFT request-s against the
    no-failure twin), the TTFT over one window common to every cell, and the recovery time."""

    def cell(v: object, unit: str = "") -> str:
        return "–" if v is None else (f"{v:.3f}{unit}" if isinstance(v, float) else f"{v}{unit}")

    rows = [("recommended", best)] + ([("today", today)] if today is not None else [])
    lines = [
        f"{'':<12} {'theta':>6} {'tau':>6} {'damage (req-s)':>15} {'common-window TTFT':>19} {'recovery':>9}"
    ]
    for name, p in rows:
        lines.append(
            f"{name:<12} {cell(p['theta']):>6} {cell(p['tau']):>6} {cell(p.get('excess_ttft_request_s')):>15} "
            f"{cell(p.get('score_ttft_s'), ' s'):>19} {cell(p.get('recovery_time_robust_s'), ' s'):>9}"
        )
    return "\n".join(lines)
