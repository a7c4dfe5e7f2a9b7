"""Gateway overhead side by side: the same synthetic workers reached directly, through Lumen, and through SMG.

    python -m loadtests.bench_smg --rates 5,20,40,80,160 --seconds 6 --repeats 2

One local Lumen cluster (`--workers` synthetic workers, `engine.time_scale` small so gateway costs
show). SMG (`pip install smg`, the SGLang model gateway) is started on a free loopback port pointing at
the same worker URLs (from GET /admin/workers), with no shim between them. Each path gets the same
open-loop request mix (Poisson arrivals at each rate, seeded prompt/output lengths, greedy,
`ignore_eos`), and each gateway path is compared with the worker endpoint it ends up calling:

- `direct`: the worker's own `/generate` (token ids), alternating between workers;
- `direct_oai`: the worker's own OpenAI `/v1/completions` (text prompt), alternating between workers;
- `lumen`: Lumen's `/v1/completions` (streamed, token-id prompt); Lumen tokenizes and calls the
  workers' `/generate`, so its baseline is `direct`;
- `lumen_gen`: Lumen's native `/generate` (token ids), baseline `direct`;
- `smg`: SMG's `/v1/completions` (text prompt: SMG refuses token-id prompts). SMG forwards the body
  as it is to the worker's `/v1/completions` (adding `echo: false`), so its baseline is `direct_oai`;
- `smg_gen`: SMG's `/generate` (token ids). SMG forwards it to the worker's `/generate` with SGLang's
  extra fields and no `rid`, which the worker accepts since a63793f; baseline `direct`.

With `--lumen-gateways 1,2` Lumen is measured twice, side by side with the rest: `lumen`/`lumen_gen`
(one gateway process) and `lumen_x2`/`lumen_gen_x2` (a second cluster, `lumen cluster up --gateways 2
--shared-port`: two gateway processes accepting on one port with SO_REUSEPORT, its own workers of the
same configuration; direct and SMG use the first cluster's workers). Each step's progress line gives the
achieved rate, TTFT p99, and how many cores the machine and the gateway kept busy.
On a shared machine, `--wait-quiet CORES` holds each step until the whole machine's busy cores (over
1 s) fall to CORES; the busy cores just before and during each step are in the report.

SMG's paths are probed first (one tiny streamed request each); a path that fails is not measured and
the probe's reply is recorded. Paths alternate (rotating order per rate and repeat) so they share
machine state. Reported per path and rate: TTFT and TPOT p50/p99, added latency vs the path's
baseline, errors, offered and achieved rate, and gateway CPU seconds per 1,000 requests (from /proc:
Lumen's gateway processes, not the cluster process that supervises them;
the SMG process), raw and net of the process's idle CPU rate measured
while other paths ran. The tables go to stdout and to `--out` with the suffix `.md`, the plot (achieved
rate and TTFT p99 against the offered rate, per path) to `--plot` or beside `--out` as `.png`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from loadtests.bench_smg.measure import gateway_counts, run
from loadtests.bench_smg.plots import plot_rates
from loadtests.bench_smg.report import tables


def _commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="5,10,20,40,80", help="offered request rates, req/s")
    ap.add_argument("--seconds", type=float, default=8.0, help="scheduled length of each (path, rate) run")
    ap.add_argument("--min-requests", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--time-scale", type=float, default=0.05)
    ap.add_argument(
        "--mode", default="stop_restart", help="Lumen recovery mode (stop_restart: no checkpoint streaming)"
    )
    ap.add_argument("--ttft-bound-ms", type=float, default=100.0, help="p99 TTFT bound for 'sustained'")
    ap.add_argument("--smg-policy", default="round_robin")
    ap.add_argument(
        "--no-lumen-generate",
        dest="lumen_generate",
        action="store_false",
        help="skip `lumen_gen` (Lumen's native /generate, like for like with SMG's /generate)",
    )
    ap.add_argument(
        "--no-smg-generate",
        dest="smg_generate",
        action="store_false",
        help="skip `smg_gen` (SMG's /generate passthrough)",
    )
    ap.add_argument(
        "--lumen-gateways",
        default="1",
        help="Lumen gateway processes, one cluster per entry (e.g. 1,2): 1 is `lumen`/`lumen_gen`; "
        "N > 1 is `lumen_xN`/`lumen_gen_xN`, N gateways accepting on one port (`--shared-port`)",
    )
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="CORES",
        help="before each step, wait until the machine's busy cores (over 1 s, this bench's idle "
        "processes included) are at most CORES (default 0: no waiting; a shared machine: e.g. 0.6)",
    )
    ap.add_argument("--wait-quiet-max-s", type=float, default=300.0, help="the longest wait before one step")
    ap.add_argument("--no-smg", dest="smg", action="store_false")
    ap.add_argument("--no-install", action="store_true", help="do not pip install smg when missing")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra Lumen config override (TOML value)",
    )
    ap.add_argument(
        "--out", default="out/bench_smg.json", help="the JSON report; the tables go beside it as .md"
    )
    ap.add_argument(
        "--plot", default="", help="the PNG of achieved rate and TTFT p99 per path (default: beside --out)"
    )
    args = ap.parse_args(argv)
    try:
        gateway_counts(args.lumen_gateways)
    except ValueError as exc:
        ap.error(str(exc))
    report: dict[str, Any] = {
        "command": "python -m loadtests.bench_smg " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores py{platform.python_version()}",
        "loadavg_at_start": os.getloadavg(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _commit(),
        "args": vars(args),
        "smg_on_path": shutil.which("smg"),
    }
    try:
        asyncio.run(run(args, report))
    finally:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1, default=lambda o: asdict(o)))
        print(f"wrote {args.out}", file=sys.stderr)
    md = tables(report)
    Path(args.out).with_suffix(".md").write_text(md)
    png = Path(args.plot) if args.plot else Path(args.out).with_suffix(".png")
    if plot_rates(report, png):
        print(f"wrote {png}", file=sys.stderr)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
