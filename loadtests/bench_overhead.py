"""Gateway overhead: the same synthetic worker reached directly and through Lumen, side by side.

    python -m loadtests.bench_overhead --requests 200 --concurrency 1,16

One local cluster with one worker. Requests alternate between the worker's own `/generate` and the
gateway's `/generate` (same input ids, same sampling), so both see the same machine state. Reported:
median and p99 TTFT and TPOT for each path, and the differences (the gateway's added
latency per request and per streamed token), plus the gateway's CPU seconds per 1,000 requests.
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
from loadtests.cluster_proc import ClusterProcess


async def _one(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[float, float]:
    t0 = time.perf_counter()
    stamps: list[float] = []
    async with http.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: {resp.status} {await resp.text()}")
        async for raw in resp.content:
            if raw.startswith(b"data:") and not raw.startswith(b"data: [DONE]"):
                stamps.append(time.perf_counter())
    # TPOT: (last chunk - first chunk) / (chunks - 1)
    return stamps[0] - t0, (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)


async def _run(gw: str, worker: str, n: int, conc: int, out_tokens: int) -> dict[str, Any]:
    rnd = random.Random(3)
    res: dict[str, dict[str, list[float]]] = {
        "direct": {"ttft": [], "tpot": []},
        "gateway": {"ttft": [], "tpot": []},
    }
    sem = asyncio.Semaphore(conc)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:

        async def job(i: int) -> None:
            ids = [rnd.randrange(32, 127) for _ in range(128)]
            body = {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": out_tokens, "temperature": 0.0},
                "stream": True,
            }
            path = "direct" if i % 2 == 0 else "gateway"
            url = (worker if path == "direct" else gw) + "/generate"
            if path == "direct":
                body["rid"] = f"bench-{i:08d}"
            async with sem:
                ttft, tpot = await _one(http, url, body)
            res[path]["ttft"].append(ttft)
            res[path]["tpot"].append(tpot)

        await asyncio.gather(*(job(i) for i in range(n)))
    return res


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    import os

    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--tokens", type=int, default=64, help="output tokens per request")
    ap.add_argument(
        "--time-scale", type=float, default=0.05, help="modelled GPU time x this (small: overhead dominates)"
    )
    ap.add_argument("--out", default="out/bench_overhead.json")
    args = ap.parse_args(argv)
    overrides = {"engine.time_scale": args.time_scale, "gateway.log_level": "warning"}
    report: dict[str, Any] = {
        "machine": f"{platform.node()} {platform.machine()} py{platform.python_version()}",
        "args": vars(args),
        "runs": {},
    }
    with ClusterProcess(workers=1, mode="stop_restart", overrides=overrides) as c:
        ws = asyncio.run(_admin_workers(c.url))
        worker_url = ws[0]["url"]
        assert c.proc is not None
        for conc in (int(x) for x in args.concurrency.split(",")):
            asyncio.run(_run(c.url, worker_url, 20, conc, args.tokens))  # warm-up
            cpu0 = _cpu_seconds(c.proc.pid)
            res = asyncio.run(_run(c.url, worker_url, args.requests, conc, args.tokens))
            cpu = _cpu_seconds(c.proc.pid) - cpu0
            row: dict[str, Any] = {}
            for path in ("direct", "gateway"):
                row[path] = {
                    "ttft_p50_ms": 1000 * float(np.percentile(res[path]["ttft"], 50)),
                    "ttft_p99_ms": 1000 * float(np.percentile(res[path]["ttft"], 99)),
                    "tpot_p50_ms": 1000 * float(np.percentile(res[path]["tpot"], 50)),
                    "tpot_p99_ms": 1000 * float(np.percentile(res[path]["tpot"], 99)),
                }
            row["added_ttft_p50_ms"] = row["gateway"]["ttft_p50_ms"] - row["direct"]["ttft_p50_ms"]
            row["added_ttft_p99_ms"] = row["gateway"]["ttft_p99_ms"] - row["direct"]["ttft_p99_ms"]
            row["added_tpot_p50_ms"] = row["gateway"]["tpot_p50_ms"] - row["direct"]["tpot_p50_ms"]
            row["added_tpot_p99_ms"] = row["gateway"]["tpot_p99_ms"] - row["direct"]["tpot_p99_ms"]
            # the cluster process also supervises; its CPU is the gateway's (workers are children)
            row["gateway_cpu_s_per_1000_req"] = 1000 * cpu / (args.requests / 2)
            report["runs"][str(conc)] = row
            print(
                f"concurrency {conc:3d}: TTFT p50 direct {row['direct']['ttft_p50_ms']:.2f} ms, via Lumen "
                f"{row['gateway']['ttft_p50_ms']:.2f} ms (+{row['added_ttft_p50_ms']:.2f}); TPOT p50 "
                f"direct {row['direct']['tpot_p50_ms']:.3f} ms, via Lumen {row['gateway']['tpot_p50_ms']:.3f} ms "
                f"(+{row['added_tpot_p50_ms']:.3f}); p99 added TTFT {row['added_ttft_p99_ms']:.2f} ms, TPOT "
                f"{row['added_tpot_p99_ms']:.3f} ms; gateway CPU {row['gateway_cpu_s_per_1000_req']:.1f} s/1000 req",
                flush=True,
            )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


async def _admin_workers(url: str) -> Any:
    async with (
        aiohttp.ClientSession() as http,
        http.get(url + "/admin/workers", headers=admin_headers(url + "/admin/workers")) as r,
    ):
        return await r.json()


if __name__ == "__main__":
    sys.exit(main())
