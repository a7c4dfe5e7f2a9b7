"""Scale run: many concurrent streams through one gateway, one worker killed (`kill -9`) mid-run.

    python -m loadtests.scale_run --workers 16 --streams 2000 --tokens 64

A local cluster of `--workers` synthetic workers; `--streams` streaming `/v1/completions` requests
are started within `--ramp-s` seconds (greedy, `ignore_eos`, fixed output length) and all run at
once. When the client has received `--kill-at-frac` of all expected tokens, one worker is killed
with POST /admin/workers/{id}/kill. The gateway process's RSS (VmRSS from /proc) is sampled every
second. Every stream must end either complete (all its tokens, a finish reason) or with an explicit
error; a stream still open at `--max-wall-s` counts as lost. Reported: RSS peak/final, outcomes,
interrupted/restored counts from GET /admin/sessions, and wall time. Bounded: stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import time
import tomllib
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from gateway.protocol.secrets import admin_headers
from loadtests.client import RequestResult, stream_completion
from loadtests.cluster_proc import ClusterProcess

# how loadtests.client reports an exception: the stream broke without an error from the gateway
CONNECTION_ERRORS = ("Client", "Server", "TimeoutError")


def _explicit(error: str | None) -> bool:
    """An HTTP error status or an error event in the stream, as opposed to a broken connection."""
    return error is not None and error != "stream truncated" and not error.startswith(CONNECTION_ERRORS)


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def _commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


async def _get(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url, headers=admin_headers(url)) as r:
        return await r.json()


async def run(args: argparse.Namespace, cluster: ClusterProcess, report: dict[str, Any]) -> None:
    assert cluster.proc is not None
    gw_pid = cluster.proc.pid
    rnd = random.Random(args.seed)
    results = [
        RequestResult(i, 0.0, [rnd.randrange(32, 127) for _ in range(args.prompt)], args.tokens, 0.0, None)
        for i in range(args.streams)
    ]
    expected = args.streams * args.tokens
    rss: list[tuple[float, float]] = []
    info: dict[str, Any] = {}
    timeout = aiohttp.ClientTimeout(total=args.max_wall_s + 60)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:
        workers = await _get(http, cluster.url + "/admin/workers")
        model = (await _get(http, cluster.url + "/v1/models"))["data"][0]["id"]
        victim = args.victim or workers[len(workers) // 2]["id"]
        t0 = time.monotonic()

        async def one(r: RequestResult) -> None:
            await asyncio.sleep(args.ramp_s * r.idx / max(1, args.streams))
            await stream_completion(http, cluster.url, model, r)

        def received() -> int:
            return sum(len(r.chunk_times) for r in results)

        async def sampler() -> None:
            while True:
                v = rss_mib(gw_pid)
                if v is not None:
                    rss.append((time.monotonic() - t0, v))
                done = sum(r.finish_reason is not None or r.error is not None for r in results)
                print(
                    f"t={time.monotonic() - t0:5.1f}s rss={v or 0:.0f} MiB tokens={received()}/{expected} "
                    f"done={done}/{args.streams}",
                    file=sys.stderr,
                )
                await asyncio.sleep(1.0)

        async def killer() -> None:
            # progress lives in the results the client fills in; polling them is the only hook
            while received() < args.kill_at_frac * expected:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
            info["kill_wall_s"] = time.monotonic() - t0
            info["open_streams_at_kill"] = sum(
                r.arrival > 0 and r.finish_reason is None and r.error is None for r in results
            )
            async with http.post(
                f"{cluster.url}/admin/workers/{victim}/kill",
                headers=admin_headers(f"{cluster.url}/admin/workers/{victim}/kill"),
            ) as resp:
                info["kill"] = {"victim": victim, "status": resp.status, "reply": await resp.json()}
            print(f"killed {victim} at {info['kill_wall_s']:.1f} s: {info['kill']}", file=sys.stderr)

        tasks = [asyncio.create_task(one(r)) for r in results]
        side = [asyncio.create_task(sampler()), asyncio.create_task(killer())]
        _, pending = await asyncio.wait(tasks, timeout=args.max_wall_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.monotonic() - t0
        for t in side:
            t.cancel()
        await asyncio.gather(*side, return_exceptions=True)
        v = rss_mib(gw_pid)
        if v is not None:
            rss.append((wall, v))
        sessions = await _get(http, cluster.url + "/admin/sessions")
        events = await _get(http, cluster.url + "/admin/events")
        workers_after = await _get(http, cluster.url + "/admin/workers")

    outcomes: Counter[str] = Counter()
    for r in results:
        if r.ok and r.completion_tokens == args.tokens:
            outcomes["complete"] += 1
        elif r.ok:
            outcomes["short (finished with fewer tokens)"] += 1
        elif r.error == "stream truncated":
            outcomes["truncated (lost)"] += 1
        elif r.error is not None and not _explicit(r.error):
            outcomes["connection broken (lost)"] += 1
        elif r.error is not None:
            outcomes["explicit error"] += 1
        else:
            outcomes["unfinished at max wall (lost)"] += 1
    inter = sessions.get("interrupted", [])
    delays = [i["resume_delay_s"] for i in inter if i.get("resume_delay_s") is not None]
    ttft = [r.ttft for r in results if r.ok and r.ttft is not None]
    tpot = [r.tpot for r in results if r.ok and r.tpot is not None]
    report.update(
        {
            "wall_s": wall,
            "kill": info,
            "rss_mib": {
                "start": rss[0][1] if rss else None,
                "peak": max(v for _, v in rss) if rss else None,
                "final": rss[-1][1] if rss else None,
                "samples": rss,
            },
            "outcomes": dict(outcomes),
            "errors": sorted({r.error for r in results if r.error})[:5],
            "tokens_received": sum(r.completion_tokens for r in results),
            "tokens_expected": expected,
            "ttft_p50_s": float(np.percentile(ttft, 50)) if ttft else None,
            "ttft_p99_s": float(np.percentile(ttft, 99)) if ttft else None,
            "tpot_p50_ms": 1000 * float(np.percentile(tpot, 50)) if tpot else None,
            "interrupted": len(inter),
            "actions": dict(Counter(str(i.get("action")) for i in inter)),
            "resumed": sum(i.get("resumed_on") is not None for i in inter),
            "restored_tokens": sum(i.get("restored_tokens") or 0 for i in inter),
            "resume_delay_p50_s": float(np.percentile(delays, 50)) if delays else None,
            "resume_delay_p99_s": float(np.percentile(delays, 99)) if delays else None,
            "workers_after": {w["id"]: w["state"] for w in workers_after},
            # every FAILED transition: the kill, and any worker declared failed without being killed
            "failed_transitions": [
                {"worker": e["worker"], "t": e["t"], "reason": e["reason"]}
                for e in events
                if e["to"] == "FAILED"
            ],
            "lost_after_first_token": sum(
                1 for r in results if not r.ok and r.chunk_times and not _explicit(r.error)
            ),
            "live_sessions_after": sessions.get("live"),
        }
    )


def print_report(r: dict[str, Any]) -> None:
    a = r["args"]
    lost = sum(v for k, v in r["outcomes"].items() if "lost" in k)
    print(
        f"\nScale run: {a['workers']} workers ({a['model']}, time_scale {a['time_scale']}, mode {a['mode']}), "
        f"{a['streams']} streams x {a['tokens']} tokens, kill -9 of {r['kill'].get('kill', {}).get('victim')} "
        f"at {r['kill'].get('kill_wall_s', float('nan')):.1f} s ({r['kill'].get('open_streams_at_kill')} streams open)\n"
    )
    print("| metric | value |")
    print("|---|---|")
    rows = [
        ("wall time", f"{r['wall_s']:.1f} s"),
        (
            "gateway RSS start / peak / final",
            "{start:.0f} / {peak:.0f} / {final:.0f} MiB".format(**r["rss_mib"]),
        ),
        ("outcomes", ", ".join(f"{k}: {v}" for k, v in sorted(r["outcomes"].items()))),
        ("lost streams (truncated or unfinished)", str(lost)),
        ("tokens received / expected", f"{r['tokens_received']} / {r['tokens_expected']}"),
        ("lost after their first token", str(r["lost_after_first_token"])),
        (
            "FAILED transitions (worker: count)",
            ", ".join(
                f"{k}: {v}" for k, v in sorted(Counter(e["worker"] for e in r["failed_transitions"]).items())
            ),
        ),
        ("interrupted / resumed", f"{r['interrupted']} / {r['resumed']}"),
        ("dispatch actions", ", ".join(f"{k}: {v}" for k, v in sorted(r["actions"].items())) or "–"),
        ("restored tokens", str(r["restored_tokens"])),
        ("resume delay p50 / p99", f"{_s(r['resume_delay_p50_s'])} / {_s(r['resume_delay_p99_s'])}"),
        ("TTFT p50 / p99", f"{_s(r['ttft_p50_s'])} / {_s(r['ttft_p99_s'])}"),
        ("TPOT p50", f"{r['tpot_p50_ms']:.1f} ms" if r["tpot_p50_ms"] is not None else "–"),
    ]
    for k, v in rows:
        print(f"| {k} | {v} |")
    if r["errors"]:
        print(f"\nerror examples: {r['errors']}")


def _s(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f} s"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--streams", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per stream")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens per stream")
    ap.add_argument("--model", default="Qwen3-8B", help="cost-model preset of the workers")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--mode", default="lumen")
    ap.add_argument("--ramp-s", type=float, default=5.0, help="streams start evenly over this long")
    ap.add_argument("--kill-at-frac", type=float, default=0.4, help="kill once this share of tokens arrived")
    ap.add_argument("--victim", default="", help="worker id to kill (default: the middle one)")
    ap.add_argument("--max-wall-s", type=float, default=240.0, help="streams still open then count as lost")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override (TOML value)"
    )
    ap.add_argument("--out", default="out/scale_run.json")
    args = ap.parse_args(argv)
    overrides = {
        "engine.time_scale": args.time_scale,
        "model.preset": args.model,
        "gateway.log_level": "warning",
        # the killed worker restarts; its reload is modelled time x time_scale
        "cluster.restart_killed": True,
    }
    for kv in args.set:
        key, _, value = kv.partition("=")
        overrides[key] = tomllib.loads(f"v = {value}")["v"]
    report: dict[str, Any] = {
        "command": "python -m loadtests.scale_run " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores py{platform.python_version()}",
        "loadavg_at_start": os.getloadavg(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _commit(),
        "args": vars(args),
    }
    log_dir = Path(args.out).with_suffix("")
    t_start = time.monotonic()
    with ClusterProcess(
        workers=args.workers, mode=args.mode, overrides=overrides, log_dir=log_dir, ready_timeout_s=120
    ) as cluster:
        report["startup_s"] = time.monotonic() - t_start
        print(f"cluster of {args.workers} ready in {report['startup_s']:.1f} s", file=sys.stderr)
        asyncio.run(run(args, cluster, report))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)
    print_report(report)
    lost = sum(v for k, v in report["outcomes"].items() if "lost" in k)
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
