"""A side-by-side run: the fault schedule from the flags, and one fresh local cluster per run driven
with the load (loadtests/sidebyside/workload.py) while /admin/workers is polled."""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from gateway.core import evaluation as ev
from gateway.protocol.secrets import admin_headers
from loadtests.client import RequestResult, stream_completion
from loadtests.cluster_proc import ClusterProcess
from loadtests.faults import FaultRunner, FaultSchedule
from loadtests.sidebyside.workload import Shape


def build_schedule(
    faults: list[str], victims: str | None, kill_at: float, workers: int, scenario: Any = None, seed: int = 1
) -> FaultSchedule:
    """The run's fault schedule: --fault specs plus kills of an explicit --victims at --kill-at;
    without either, the scenario's first failure (a slow one stays slow) or w0 at --kill-at.
    Raises FaultSpecError naming the bad spec, an unknown worker included."""
    specs = list(faults)
    if victims:
        specs += [f"kill:{v}@{kill_at!r}" for v in victims.split(",") if v]
    elif not faults:
        if scenario is not None and scenario.failures:
            f = scenario.failures[0]
            factor = f"x{f.slowdown!r}" if f.kind == "slow" else ""
            specs += [f"{f.kind}:{v}@{kill_at!r}{factor}" for v in scenario.victims(seed)[0] or ["w0"]]
        else:
            specs.append(f"kill:w0@{kill_at!r}")
    schedule = FaultSchedule.parse(specs)
    schedule.check_workers({f"w{i}" for i in range(workers)})
    return schedule


def _results(shapes: list[Shape], seed: int) -> list[RequestResult]:
    rnd = random.Random(seed + 1)
    return [
        RequestResult(
            i, 0.0, [rnd.randrange(32, 127) for _ in range(s.prompt_tokens)], s.output_tokens, 0.0, None
        )
        for i, s in enumerate(shapes)
    ]


QUEUE_FIELDS = ("state", "running", "waiting", "ckpt_tokens")


async def poll_workers(
    http: aiohttp.ClientSession, url: str, t0: float, samples: list[dict[str, Any]], period_s: float
) -> None:
    """Append `{t, workers: {id: {state, running, waiting, ckpt_tokens}}}` every `period_s` until
    cancelled; a missed poll (gateway busy) is a gap, not an error."""
    next_at = time.monotonic()
    while True:
        try:
            async with http.get(
                f"{url}/admin/workers",
                headers=admin_headers(f"{url}/admin/workers"),
                timeout=aiohttp.ClientTimeout(total=5),
            ) as resp:
                ws = await resp.json()
            samples.append(
                {
                    "t": round(time.monotonic() - t0, 3),
                    "workers": {w["id"]: {k: w.get(k) for k in QUEUE_FIELDS} for w in ws},
                }
            )
        except (aiohttp.ClientError, TimeoutError, ValueError):
            pass
        next_at = max(next_at + period_s, time.monotonic())
        await asyncio.sleep(next_at - time.monotonic())


async def _drive(
    urls: list[str],
    shapes: list[Shape],
    results: list[RequestResult],
    schedule: FaultSchedule,
    seed: int,
    poll_s: float,
    drain_s: float,
) -> dict[str, Any]:
    """The load, spread over the cluster's gateways (round robin); a client whose gateway dies resumes
    its stream on the next one (Last-Event-ID). A request with no answer `drain_s` after the last
    arrival is cancelled and counted as an error (`info["unanswered"]`: their ids): a stuck stream is
    a finding, not a reason to wait forever."""
    info: dict[str, Any] = {"queue": [], "unanswered": []}
    url = urls[0]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        t0 = time.monotonic()
        faults = FaultRunner(http, url, schedule, seed=seed, t0=t0, gateway_urls=urls)

        async def one(s: Shape, r: RequestResult) -> None:
            await asyncio.sleep(max(0.0, s.at - (time.monotonic() - t0)))
            mine = urls[r.idx % len(urls)]
            others = [u for u in urls if u != mine]
            await stream_completion(http, mine, "lumen-synthetic", r, resume_urls=others)

        async def progress() -> None:
            while True:
                await asyncio.sleep(2.0)
                done = sum(1 for r in results if r.finish_reason or r.error)
                sys.stderr.write(f"\r  t={time.monotonic() - t0:5.1f}s  done {done}/{len(results)}  ")
                sys.stderr.flush()

        tasks = [asyncio.create_task(one(s, r)) for s, r in zip(shapes, results, strict=True)]
        side = [
            asyncio.create_task(progress()),
            asyncio.create_task(poll_workers(http, url, t0, info["queue"], poll_s)),
        ]
        if schedule:
            # undos still pending when the load ends are dropped: the cluster stops with the run
            side.append(asyncio.create_task(faults.run()))
        last_at = max((s.at for s in shapes), default=0.0)
        deadline = last_at + drain_s - (time.monotonic() - t0)
        _done, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline)) if tasks else (set(), set())
        if pending:
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            stuck = [r for r in results if not (r.finish_reason or r.error)]
            for r in stuck:
                r.error = f"no answer {drain_s:g} s after the last arrival"
            # request index, the gateway's id once it answered, and the tokens it had streamed
            info["unanswered"] = [f"#{r.idx} {r.rid or '(no id)'} {len(r.chunk_times)} chunks" for r in stuck]
            sys.stderr.write(
                f"\n  {len(stuck)} request(s) unanswered after --drain-s: {info['unanswered']}\n"
            )
        for t in side:
            t.cancel()
        await asyncio.gather(*side, return_exceptions=True)
        sys.stderr.write("\n")
        info["t0"] = t0
        info["faults"] = faults.fired
        # every gateway's sessions (a killed gateway's are gone with it; its clients resumed elsewhere)
        info["sessions"] = {"interrupted": []}
        for u in urls:
            try:
                async with http.get(
                    f"{u}/admin/sessions",
                    headers=admin_headers(f"{u}/admin/sessions"),
                    timeout=aiohttp.ClientTimeout(total=10),
                ) as resp:
                    info["sessions"]["interrupted"] += (await resp.json())["interrupted"]
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
                sys.stderr.write(f"  (no sessions from {u})\n")
        async with http.get(f"{url}/admin/workers", headers=admin_headers(f"{url}/admin/workers")) as resp:
            info["workers"] = await resp.json()
        info["resumed_streams"] = sum(r.resumes for r in results)
    return info


def _records(results: list[RequestResult], t0: float, interrupted: set[str]) -> list[ev.RequestRecord]:
    recs = []
    for r in results:
        ok = r.ok
        first = r.chunk_times[0] - t0 if ok and r.chunk_times else None
        last = r.chunk_times[-1] - t0 if ok and r.chunk_times else None
        recs.append(
            ev.RequestRecord(
                arrival=r.arrival - t0,
                first_token=first,
                last_token=last,
                output_tokens=r.completion_tokens if first is not None else 0,
                interrupted=r.rid in interrupted,
                error=not ok,
            )
        )
    return recs


def run_mode(
    mode: str, args: argparse.Namespace, shapes: list[Shape], schedule: FaultSchedule, log_dir: Path
) -> tuple[list[ev.RequestRecord], dict[str, Any]]:
    """One fresh cluster in `mode` under the load, `schedule` fired against it (empty: the reference)."""
    from gateway.config import parse_set

    overrides = {
        "engine.time_scale": args.time_scale,
        "engine.max_running_requests": args.max_running,
        "engine.model_load_s": args.model_load_s,
        "gateway.log_level": "warning",
        "model.preset": args.model,
        **parse_set(args.set),
    }
    results = _results(shapes, args.seed)
    label = f"{mode}{'' if schedule else ' (no failure)'}"
    sys.stderr.write(f"[{label}] starting {args.workers} workers\n")
    gateways = getattr(args, "gateways", 1)
    with ClusterProcess(
        workers=args.workers, mode=mode, overrides=overrides, log_dir=log_dir, gateways=gateways
    ) as c:
        urls = list(c.ready.get("urls") or [c.url])
        info = asyncio.run(_drive(urls, shapes, results, schedule, args.seed, args.poll, args.drain_s))
    interrupted = {i["rid"] for i in info["sessions"]["interrupted"]}
    records = _records(results, info["t0"], interrupted)
    info["restores"] = sum(1 for i in info["sessions"]["interrupted"] if i.get("restored_tokens"))
    info["replays"] = len(info["sessions"]["interrupted"]) - info["restores"]
    info["restored_tokens"] = sum(i.get("restored_tokens", 0) for i in info["sessions"]["interrupted"])
    drafted = sum(w.get("drafted_tokens", 0) for w in info["workers"])
    accepted = sum(w.get("accepted_tokens", 0) for w in info["workers"])
    info["draft_tokens_verified"] = drafted
    info["draft_accepted_fraction"] = accepted / drafted if drafted else None
    # the restarts' reloads as the workers reported them (the simulator's `reload_source`, `reload_s`)
    reloads = [w["reload"] for w in info["workers"] if w.get("reload")]
    info["reload_source"] = "/".join(sorted({r["source"] for r in reloads})) or None
    info["reload_s"] = sum(r["seconds"] for r in reloads) / len(reloads) if reloads else None
    return records, info
