"""Gateway CPU per streamed request: the figure to watch while making the gateway cheaper.

    python -m loadtests.bench_smg.cpu --rate 40 --seconds 8 --repeats 3 [--baseline DIR]

One Lumen cluster (one gateway process, `--workers` synthetic workers, the overhead bench's
configuration) driven with the overhead bench's open-loop mix on `/v1/completions` and `/generate`;
reported per path: the gateway process's CPU milliseconds per completed request (utime + stime from
/proc, the process's idle rate between runs subtracted), which is far less noisy on a shared machine
than the rate it sustains. With `--baseline DIR` (a checkout of another commit, e.g. `git worktree add
DIR HEAD`) a second cluster runs that code and the two take turns run by run, so both see the same
machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp

from gateway.protocol.secrets import TOKEN_ENV, generate_token
from loadtests.bench_smg.drive import Target, cpu_seconds, drive, workload
from loadtests.cluster_proc import ClusterProcess


@contextlib.contextmanager
def _cwd(path: Path | None) -> Iterator[None]:
    """Start processes from `path` (`python -m gateway.cli` then imports that checkout's code)."""
    old = Path.cwd()
    if path is not None:
        os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


async def _idle_rate(pid: int, seconds: float = 1.0) -> float:
    c0 = cpu_seconds(pid)
    await asyncio.sleep(seconds)
    return (cpu_seconds(pid) - c0) / seconds


async def _measure(
    targets: list[tuple[str, Target, int]], args: argparse.Namespace
) -> dict[str, list[float]]:
    ms: dict[str, list[float]] = {name: [] for name, _, _ in targets}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300)) as http:
        for _, t, _ in targets:  # warm-up
            await drive(http, t, workload(5.0, 1.0, 5, 99))
        for rep in range(args.repeats):
            shapes = workload(args.rate, args.seconds, 20, args.seed + rep)
            order = targets[rep % len(targets) :] + targets[: rep % len(targets)]
            for name, t, pid in order:
                idle = await _idle_rate(pid)
                c0, w0 = cpu_seconds(pid), time.monotonic()
                samples, _ = await drive(http, t, shapes)
                cpu, wall = cpu_seconds(pid) - c0, time.monotonic() - w0
                ok = sum(1 for s in samples if s.error is None)
                errors = len(samples) - ok
                per = 1000 * (cpu - idle * wall) / max(ok, 1)
                ms[name].append(per)
                print(
                    f"rep {rep + 1} {name}: {ok} ok, {errors} errors, {per:.2f} ms CPU/request "
                    f"(raw {1000 * cpu / max(ok, 1):.2f}, idle {idle:.3f} core), {wall:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
    return ms


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=40.0)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--time-scale", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=23)
    ap.add_argument("--paths", default="completions,generate", help="completions and/or generate")
    ap.add_argument("--baseline", type=Path, default=None, help="a checkout of the code to compare with")
    ap.add_argument("--log-dir", type=Path, default=Path("out/bench_cpu"))
    args = ap.parse_args(argv)
    overrides = {"engine.time_scale": args.time_scale, "gateway.log_level": "warning"}
    env = {TOKEN_ENV: generate_token()}
    checkouts: list[tuple[str, Path | None]] = [("now", None)]
    if args.baseline is not None:
        checkouts.append(("base", args.baseline.resolve()))
    with contextlib.ExitStack() as stack:
        targets: list[tuple[str, Target, int]] = []
        for label, where in checkouts:
            with _cwd(where):
                c = stack.enter_context(
                    ClusterProcess(
                        workers=args.workers, mode="stop_restart", overrides=overrides, env=env,
                        log_dir=(args.log_dir / label).resolve(),
                    )
                )  # fmt: skip
            pid = (c.ready.get("gateway_pids") or [0])[0]
            for kind in args.paths.split(","):
                name = f"{label} {kind}"
                targets.append((name, Target(name, [c.url], kind, model="lumen-synthetic"), pid))
        ms = asyncio.run(_measure(targets, args))
    print(f"gateway CPU ms per request at {args.rate:g} req/s (median of {args.repeats}, net of idle):")
    for name, xs in ms.items():
        print(f"  {name}: {statistics.median(xs):.2f}  (runs: {', '.join(f'{x:.2f}' for x in xs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
