"""`lumen chaos`: a bounded randomized run across network namespaces, checked, with a report.

    lumen chaos --duration 60 --fault-rate 6 --seed 7 --gateways 2 --workers 3 --out out/chaos
    lumen chaos --duration 20 --fault-rate 0 --fault 'partition:w0|gw@5+3' --fault kill:w1@9 --out out/c

The run is reproducible from its seed: the same requests, arrivals and fault schedule (the
schedule's text is printed and written to the report). Exit status: 0 no violation, 1 violations,
2 the run could not be made (bad input, not root, a command missing).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from gateway.config import ConfigError, load_config, parse_set
from loadtests.chaos.netfaults import delay_backend, nft_missing
from loadtests.chaos.netns import LabError, cleanup_leftovers, missing_tools
from loadtests.chaos.netspec import NetSpecError
from loadtests.chaos.orchestrate import ChaosSetup, hosts_of, run_chaos, validate
from loadtests.chaos.randomplan import random_faults
from loadtests.chaos.report import plot_timeline, write_markdown
from loadtests.faults import FaultSpecError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lumen chaos", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", required=True, help="folder for report.md, timeline.png, history.json, logs/")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of load (arrivals span this)")
    p.add_argument("--fault-rate", type=float, default=6.0, help="random faults per minute (0: only --fault)")
    p.add_argument(
        "--fault", action="append", default=[], help="a fixed fault (repeatable; process or network kinds)"
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--gateways", type=int, default=2)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--rate", type=float, default=4.0, help="requests per second")
    p.add_argument("--max-out", type=int, default=120, help="the longest output a request asks for")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a gateway config override (TOML value)",
    )
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if why := missing_tools() or nft_missing() or (None if shutil.which("openssl") else "openssl is missing"):
        print(f"lumen chaos: cannot run here: {why}", file=sys.stderr)
        return 2
    cleanup_leftovers()
    gws, ws, _ = hosts_of(ChaosSetup(gateways=args.gateways, workers=args.workers))
    try:
        overrides = parse_set(args.set)
        load_config(overrides=overrides)  # a bad key or value stops here, naming it
        faults = list(args.fault)
        if args.fault_rate > 0:
            faults += random_faults(
                args.seed,
                args.duration,
                args.fault_rate,
                gateways=gws,
                workers=ws,
                delay=delay_backend() is not None,
            )
        setup = ChaosSetup(
            gateways=args.gateways,
            workers=args.workers,
            faults=faults,
            seed=args.seed,
            requests=max(1, round(args.duration * args.rate)),
            rate=args.rate,
            max_out=args.max_out,
            overrides=overrides,
            deadline_s=args.duration + 150.0,
        )
        validate(setup)
        print(
            f"lumen chaos: seed {args.seed}, {setup.requests} requests, faults: {' '.join(faults) or 'none'}"
        )
        result = run_chaos(
            setup,
            Path(args.out),
            progress=lambda line: print(f"lumen chaos: {line}", file=sys.stderr, flush=True),
        )
    except (FaultSpecError, NetSpecError, ConfigError, ValueError, LabError) as exc:
        print(f"lumen chaos: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    title = f"lumen chaos --duration {args.duration:g} --fault-rate {args.fault_rate:g} --seed {args.seed}"
    write_markdown(result.history, result.report, out / "report.md", title=title)
    why_no_plot = plot_timeline(result.history, result.report, out / "timeline.png")
    rep = result.report
    print(
        f"lumen chaos: {rep.requests} requests, {rep.exact} exact, {rep.clean_errors} clean errors, "
        f"{rep.resumed} resumes, faults {rep.faults}; violations {rep.by_rule() or 0}"
    )
    for v in rep.violations[:10]:
        print(f"  violation {v.rule}: request {v.request}: {v.detail}")
    print(
        f"lumen chaos: report {out / 'report.md'}"
        + (f" (no plot: {why_no_plot})" if why_no_plot else f", {out / 'timeline.png'}")
    )
    return 0 if rep.ok else 1
