"""Side-by-side live runs: the same workload and seed against a fresh local cluster in each mode.

    python -m loadtests.sidebyside --modes stop_restart,fixed_checkpoint,lumen --out out/live-paper-4w

For every mode: one run with the fault schedule, and one run without it (the no-failure twin that
recovery is measured against, docs/evaluation.md). The load is the conv-like generator (`--rate`) or a
trace: `--trace FILE` with `--speedup X`, `--rate R` (as a speedup) or `--calibrate-ttft T`
(loadtests/sidebyside/workload.py); summary.json's `workload` names what ran. The schedule is `--fault KIND:TARGET@SECONDS[xFACTOR][+DURATION]`, repeated
(loadtests/faults.py: kill, hang, stall or slow; a worker id, random, busiest or top-holder), e.g.

    --fault slow:w1@5x4 --fault kill:top-holder@12 --fault kill:random@12

`--victims V1,V2` adds kills (`kill -9`) of those workers at `--kill-at`; with neither --fault nor
--victims, the scenario's first failure (kill or slow, on its workers) or else a kill of w0 strikes
at `--kill-at`, as before fault schedules. Recovery is measured from the first fault that fired. Metrics come from `gateway.core.evaluation`, the implementation the
simulator uses too. The gateway's /admin/workers is polled every `--poll` seconds during each run.
Writes summary.json (the same per-mode keys as `lumen sim`, plus the faults fired: time, kind,
resolved worker), summary.md, timelines.json (the polled worker queues and the faults of every run),
timeline.png (TTFT, TPOT and queued requests over time, faults and recovery marked) and
queues-MODE.png (running and waiting requests per worker in that mode's faulted run).
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gateway.core import evaluation as ev
from gateway.sim.workload import TraceError, workload_label
from loadtests.faults import FaultSchedule, FaultSpecError
from loadtests.sidebyside.drive import build_schedule, run_mode
from loadtests.sidebyside.report import add_fair_measures, first_fault_at, fmt, summarize, write_report
from loadtests.sidebyside.workload import DEFAULT_RATE, LoadError, build_load

DRAIN_S = 300.0  # --drain-s: well past any recovery a local cluster goes through (model loads of ~20 s)

SUMMARY_KEYS = (  # the damage first: it compares modes fairly (docs/evaluation.md)
    "excess_ttft_request_s",
    "recovery_time_s",
    "ttft_mean_s",
    "tpot_mean_s",
    "impact_ttft_mean_s",
    "impact_tpot_mean_s",
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--scenario", help="take workers, model and its first failure from configs/scenarios/NAME.toml"
    )
    ap.add_argument("--modes", default="stop_restart,fixed_checkpoint,lumen")
    ap.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="KIND:TARGET@SECONDS[xFACTOR][+DURATION]",
        help="a fault event (repeat for more; same SECONDS: at once), e.g. slow:w1@5x4, hang:busiest@8+2, "
        "kill:top-holder@12, kill:random@12 (loadtests/faults.py)",
    )
    ap.add_argument(
        "--victims",
        help="workers killed at --kill-at (comma-separated; default w0, or the scenario's, when no --fault)",
    )
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument(
        "--gateways", type=int, default=1, help="gateway processes (kill-gateway faults need 2 or more)"
    )
    ap.add_argument("--model", default="Qwen3-32B")
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals")
    ap.add_argument(
        "--rate",
        type=float,
        help="requests per second of the conv-like generator (default 6); with --trace it sets the speedup "
        "so that the trace's mean rate becomes this",
    )
    ap.add_argument(
        "--trace",
        type=Path,
        metavar="FILE",
        help="replay this CSV (TIMESTAMP, ContextTokens, GeneratedTokens): its first --duration seconds "
        "after the speedup, lengths x --scale",
    )
    ap.add_argument("--speedup", type=float, metavar="X", help="replay the trace X times faster (default 1)")
    ap.add_argument(
        "--calibrate-ttft",
        type=float,
        metavar="T",
        help="with --trace: the speedup whose no-failure mean TTFT is T s, found in the simulator on a "
        "mirror of this cluster (the gateway's own CPU time is not modelled)",
    )
    ap.add_argument("--scale", type=float, default=0.5, help="length scale of the conv-like workload")
    ap.add_argument("--kill-at", type=float, default=15.0)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--max-running", type=int, default=16)
    ap.add_argument("--model-load-s", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=1, help="workload, and the draws of `random` fault targets")
    ap.add_argument("--poll", type=float, default=0.5, help="seconds between /admin/workers polls")
    ap.add_argument(
        "--drain-s",
        type=float,
        default=DRAIN_S,
        help="seconds after the last arrival that a request may still take; one still open then is "
        "cancelled, counted as an error and listed, and the run exits 1",
    )
    ap.add_argument("--baseline-per-mode", action="store_true", help="a no-failure run for every mode")
    ap.add_argument("--out", default="out/sidebyside")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    sc = None
    if args.scenario:
        from gateway.sim.scenario import load_scenario

        sc = load_scenario(args.scenario)
        args.workers, args.model = sc.cluster.workers, sc.cluster.model
        # the scenario's rate is for modelled GPUs; a CPU box streams ~14 req/s per 4 workers at best
        if args.trace is None:
            args.rate = min(DEFAULT_RATE if args.rate is None else args.rate, 3.5 * args.workers)
    if not args.poll > 0:
        ap.error(f"--poll must be > 0, got {args.poll}")
    if not args.drain_s > 0:
        ap.error(f"--drain-s must be > 0, got {args.drain_s}")
    try:
        schedule = build_schedule(args.fault, args.victims, args.kill_at, args.workers, sc, args.seed)
    except FaultSpecError as exc:
        ap.error(str(exc))
    out = Path(args.out)
    try:
        shapes, workload = build_load(args)
    except (LoadError, TraceError) as exc:
        ap.error(str(exc))
    sys.stderr.write(f"workload: {workload_label(workload)}\n")
    modes = [m for m in args.modes.split(",") if m]
    t_start = time.monotonic()
    summary: dict[str, Any] = {
        "workers": args.workers,
        "seed": args.seed,
        "requests": len(shapes),
        "workload": workload,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "faults": [str(e) for e in schedule.events],
        "machine": f"{platform.node()} {platform.machine()} py{platform.python_version()}",
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "date": time.strftime("%Y-%m-%d"),
        "modes": {},
    }
    series: dict[str, list[ev.RequestRecord]] = {}
    timelines: dict[str, dict[str, Any]] = {}
    shared_base: list[ev.RequestRecord] | None = None
    unanswered: dict[str, list[str]] = {}  # run -> its requests still open at --drain-s
    for mode in modes:
        if args.baseline_per_mode or shared_base is None:
            name = f"no failure ({mode})"
            base, base_info = run_mode(mode, args, shapes, FaultSchedule(), out / "logs" / f"{mode}-base")
            shared_base = base
            series[name] = base
            if base_info["unanswered"]:
                unanswered[name] = base_info["unanswered"]
            timelines[name] = {"queue": base_info["queue"], "faults": []}
        failed, info = run_mode(mode, args, shapes, schedule, out / "logs" / mode)
        series[mode] = failed
        if info["unanswered"]:
            unanswered[mode] = info["unanswered"]
        failure_at = first_fault_at(info["faults"], schedule)
        row = summarize(failed, shared_base, failure_at)
        row.update(
            {
                k: info[k]
                for k in (
                    "restores",
                    "replays",
                    "restored_tokens",
                    "draft_tokens_verified",
                    "draft_accepted_fraction",
                    "reload_source",
                    "reload_s",
                )
            }
        )
        row["failure_at_s"] = failure_at
        row["faults"] = [{k: v for k, v in f.items() if k != "snapshot"} for f in info["faults"]]
        summary["modes"][mode] = row
        timelines[mode] = {
            "queue": info["queue"],
            "faults": info["faults"],
            "failure_at": failure_at,
            "recovery_time_s": row["recovery_time_s"],
        }
        print(
            f"{mode}: " + ", ".join(f"{k}={fmt(row[k])}" for k in (*SUMMARY_KEYS, "client_errors")),
            flush=True,
        )
    add_fair_measures(summary["modes"], series)
    summary["unanswered"] = unanswered
    summary["simulated_s"] = None
    summary["wall_s"] = time.monotonic() - t_start
    write_report(out, summary, series, float(schedule.first_at or args.kill_at), timelines)
    print((out / "summary.md").read_text())
    for name, ids in unanswered.items():
        sys.stderr.write(f"[{name}] {len(ids)} request(s) got no answer (logs: {out / 'logs'}): {ids}\n")
    return 1 if unanswered else 0


if __name__ == "__main__":
    sys.exit(main())
