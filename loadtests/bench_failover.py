"""Failure-detection latency and resume delay, measured on a live local cluster.

    python -m loadtests.bench_failover --kills 30 --hangs 30

Each round waits for every worker to be HEALTHY, kills -9 (or SIGSTOPs) one worker chosen in turn
while a light streaming load runs, and reads, on the gateway's own clock, the time from the signal to
the FAILED transition (/admin/events). Interrupted requests' resume delays (last token before the
failure to first token after it) come from /admin/sessions. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from gateway.protocol.secrets import admin_headers
from loadtests.client import RequestResult, stream_completion
from loadtests.cluster_proc import ClusterProcess


async def _get(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url, headers=admin_headers(url)) as r:
        return await r.json()


async def _post(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.post(url, headers=admin_headers(url)) as r:
        return await r.json()


async def _background_load(
    http: aiohttp.ClientSession, url: str, stop: asyncio.Event, out: list[RequestResult]
) -> None:
    rnd = random.Random(5)
    tasks: set[asyncio.Task[RequestResult]] = set()
    i = 0
    while not stop.is_set():
        r = RequestResult(i, 0.0, [rnd.randrange(32, 127) for _ in range(64)], 200, 0.0, None)
        out.append(r)
        t = asyncio.create_task(stream_completion(http, url, "lumen-synthetic", r))
        tasks.add(t)
        t.add_done_callback(tasks.discard)
        i += 1
        await asyncio.sleep(rnd.expovariate(20.0))
    await asyncio.gather(*tasks)


async def _rounds(url: str, n: int, mode: str, workers: int, results: dict[str, list[float]]) -> None:
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        stop = asyncio.Event()
        load_results: list[RequestResult] = []
        load = asyncio.create_task(_background_load(http, url, stop, load_results))
        for k in range(n):
            wid = f"w{k % workers}"
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                ws = await _get(http, f"{url}/admin/workers")
                if all(w["state"] == "HEALTHY" for w in ws):
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)  # let the load spread onto the rejoined worker
            n_events = len(await _get(http, f"{url}/admin/events"))
            res = await _post(
                http, f"{url}/admin/workers/{wid}/kill?mode={'hang' if mode == 'hang' else 'kill'}"
            )
            failed = None
            while failed is None:
                await asyncio.sleep(0.02)
                evs = (await _get(http, f"{url}/admin/events"))[n_events:]
                failed = next((e for e in evs if e["worker"] == wid and e["to"] == "FAILED"), None)
            results[f"detect_{mode}_s"].append(failed["t"] - res["at"])
            if mode == "hang":
                await asyncio.sleep(0.2)
                await _post(http, f"{url}/admin/workers/{wid}/kill?mode=resume")
            sys.stderr.write(
                f"\r{mode}: {k + 1}/{n} rounds, last detection {1000 * (failed['t'] - res['at']):.1f} ms "
            )
            sys.stderr.flush()
        sys.stderr.write("\n")
        stop.set()
        await load
        sessions = await _get(http, f"{url}/admin/sessions")
        results[f"resume_{mode}_s"] = [
            i["resume_delay_s"] for i in sessions["interrupted"] if i["resume_delay_s"] is not None
        ]
        results[f"errors_{mode}"] = [float(sum(1 for r in load_results if not r.ok))]
        results[f"requests_{mode}"] = [float(len(load_results))]


def _fmt(xs: list[float]) -> str:
    if not xs:
        return "n=0"
    a = np.asarray(xs) * 1000
    return f"n={len(a)}  p50 {np.percentile(a, 50):.1f} ms  p99 {np.percentile(a, 99):.1f} ms  max {a.max():.1f} ms"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=30)
    ap.add_argument("--hangs", type=int, default=30)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--out", default="out/bench_failover.json")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    from gateway.config import parse_set

    overrides = {
        "engine.time_scale": 0.5,
        "engine.model_load_s": 0.5,
        "gateway.log_level": "warning",
        **parse_set(args.set),
    }
    results: dict[str, list[float]] = {k: [] for k in ("detect_kill_s", "detect_hang_s")}
    with ClusterProcess(workers=args.workers, mode="stop_restart", overrides=overrides) as c:
        if args.kills:
            asyncio.run(_rounds(c.url, args.kills, "kill", args.workers, results))
        if args.hangs:
            asyncio.run(_rounds(c.url, args.hangs, "hang", args.workers, results))
    print(
        f"machine: {platform.node()} {platform.machine()} python {platform.python_version()}; overrides {overrides}"
    )
    print(f"kill -9 -> FAILED       {_fmt(results['detect_kill_s'])}")
    print(f"SIGSTOP -> FAILED       {_fmt(results['detect_hang_s'])}")
    for mode in ("kill", "hang"):
        if f"resume_{mode}_s" in results:
            print(
                f"resume delay ({mode:4})     {_fmt(results[f'resume_{mode}_s'])}   "
                f"client errors {int(results[f'errors_{mode}'][0])}/{int(results[f'requests_{mode}'][0])}"
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"overrides": overrides, **results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
