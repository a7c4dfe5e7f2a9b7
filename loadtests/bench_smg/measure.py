"""The overhead bench's measurement: one Lumen cluster and SMG in front of its workers, every path
driven at every rate (rotating order), gateway CPU accounted from /proc, and the samples turned into
rows: percentiles, added latency vs the path's baseline, CPU per 1,000 requests, max sustained rate."""

from __future__ import annotations

import argparse
import json
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from loadtests.bench_smg.drive import Sample, Target, cpu_seconds, drive, workload
from loadtests.bench_smg.smg_process import Smg, probe, smg_binary
from loadtests.cluster_proc import ClusterProcess


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) * 1000.0 if xs else None


def summarize(runs: list[tuple[list[Sample], float]], rate: float) -> dict[str, Any]:
    ok = [s for samples, _ in runs for s in samples if s.error is None]
    errors = [s.error for samples, _ in runs for s in samples if s.error is not None]
    offered: list[float] = []
    achieved: list[float] = []
    lag: list[float] = []
    for samples, t0 in runs:
        good = [s for s in samples if s.error is None]
        span_sched = samples[-1].sched - samples[0].sched
        offered.append((len(samples) - 1) / span_sched if span_sched > 0 else rate)
        if len(good) > 1:
            # same form as offered: completions over the span between the first and last completion
            achieved.append((len(good) - 1) / (max(s.done for s in good) - min(s.done for s in good)))
        lag.extend(s.sent - t0 - s.sched for s in samples)
    ttft = [s.ttft for s in ok if s.ttft is not None]
    tpot = [s.tpot for s in ok if s.tpot is not None]
    return {
        "rate": rate,
        "requests": sum(len(r[0]) for r in runs),
        "ok": len(ok),
        "errors": len(errors),
        "error_examples": sorted(set(errors))[:3],
        "ttft_p50_ms": _pct(ttft, 50),
        "ttft_p99_ms": _pct(ttft, 99),
        "tpot_p50_ms": _pct(tpot, 50),
        "tpot_p99_ms": _pct(tpot, 99),
        "offered_rps": float(np.mean(offered)),
        "achieved_rps": float(np.mean(achieved)) if achieved else 0.0,
        "send_lag_p99_ms": _pct(lag, 99),
    }


async def run(args: argparse.Namespace, report: dict[str, Any]) -> None:
    rates = [float(x) for x in args.rates.split(",")]
    overrides: dict[str, Any] = {"engine.time_scale": args.time_scale, "gateway.log_level": "warning"}
    for kv in args.set:
        key, _, value = kv.partition("=")
        overrides[key] = tomllib.loads(f"v = {value}")["v"]
    log_dir = Path(args.out).with_suffix("")
    log_dir.mkdir(parents=True, exist_ok=True)
    exe, smg_info = smg_binary(not args.no_install) if args.smg else (None, "skipped (--no-smg)")
    report["smg"] = {"version_or_reason": smg_info}
    smg: Smg | None = None
    with ClusterProcess(
        workers=args.workers, mode=args.mode, overrides=overrides, log_dir=log_dir
    ) as cluster:
        assert cluster.proc is not None
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300)) as http:
            async with http.get(cluster.url + "/admin/workers") as r:
                workers = await r.json()
            worker_urls = [w["url"] for w in workers]
            async with http.get(cluster.url + "/v1/models") as r:
                lumen_model = (await r.json())["data"][0]["id"]
            targets = [
                Target("direct", worker_urls, "generate"),
                Target("direct_oai", worker_urls, "completions", lumen_model, True),
                Target(
                    "lumen", [cluster.url], "completions", model=lumen_model, pids={"lumen": cluster.proc.pid}
                ),
            ]
            if args.lumen_generate:
                targets.append(
                    Target("lumen_gen", [cluster.url], "generate", pids={"lumen": cluster.proc.pid})
                )
            try:
                if exe is not None:
                    smg = Smg(exe, worker_urls, args.smg_policy, log_dir / "smg.log")
                    await smg.ready(http)
                    async with http.get(smg.url + "/v1/models") as r:
                        smg_model = (await r.json())["data"][0]["id"]
                    found = await probe(http, smg.url, smg_model)
                    report["smg"]["probe"] = found
                    report["smg"]["cmd"] = " ".join(smg.cmd)
                    print(f"SMG probe against the workers: {json.dumps(found)}", file=sys.stderr)
                    pids = {"smg": smg.proc.pid}
                    if found["/v1/completions"]["ok"]:
                        targets.append(
                            Target("smg", [smg.url], "completions", smg_model, True, pids, "direct_oai")
                        )
                    if found["/generate"]["ok"] and args.smg_generate:
                        targets.append(Target("smg_gen", [smg.url], "generate", pids=pids))
                    report["smg"]["measured"] = [t.name for t in targets if t.name.startswith("smg")]
                    if not report["smg"]["measured"]:
                        report["smg"]["not_measured"] = "no SMG endpoint worked against these workers"
                await _measure(http, targets, rates, args, report)
            finally:
                if smg is not None:
                    smg.stop()


async def _measure(
    http: aiohttp.ClientSession,
    targets: list[Target],
    rates: list[float],
    args: argparse.Namespace,
    report: dict[str, Any],
) -> None:
    all_pids = {k: v for t in targets for k, v in t.pids.items()}
    # per pid: CPU and wall while its path ran ("on") and while others ran ("off", its idle rate)
    acct = {k: {"on_cpu": 0.0, "on_wall": 0.0, "off_cpu": 0.0, "off_wall": 0.0} for k in all_pids}
    for t in targets:  # warm-up: connections, first-request paths
        await drive(http, t, workload(5.0, 1.0, 5, 99))
    runs: dict[tuple[str, float], list[tuple[list[Sample], float]]] = {}
    cpu_on: dict[tuple[str, float], float] = {}
    wall_on: dict[tuple[str, float], float] = {}
    k = 0
    for rep in range(args.repeats):
        for rate in rates:
            shapes = workload(rate, args.seconds, args.min_requests, args.seed + int(rate * 1000) + rep)
            order = targets[k % len(targets) :] + targets[: k % len(targets)]
            k += 1
            for t in order:
                c0 = {p: cpu_seconds(pid) for p, pid in all_pids.items()}
                w0 = time.monotonic()
                samples, t0 = await drive(http, t, shapes)
                wall = time.monotonic() - w0
                for p, pid in all_pids.items():
                    d = cpu_seconds(pid) - c0[p]
                    side = "on" if p in t.pids else "off"
                    acct[p][f"{side}_cpu"] += d
                    acct[p][f"{side}_wall"] += wall
                    if p in t.pids:
                        cpu_on[(t.name, rate)] = cpu_on.get((t.name, rate), 0.0) + d
                        wall_on[(t.name, rate)] = wall_on.get((t.name, rate), 0.0) + wall
                runs.setdefault((t.name, rate), []).append((samples, t0))
                bad = sum(s.error is not None for s in samples)
                print(
                    f"rep {rep + 1} rate {rate:g}/s {t.name}: {len(samples)} req, {bad} errors, {wall:.1f} s",
                    file=sys.stderr,
                )
    idle = {p: a["off_cpu"] / a["off_wall"] if a["off_wall"] else 0.0 for p, a in acct.items()}
    report["idle_cpu_rate"] = idle
    rows: dict[str, dict[str, Any]] = {}
    for t in targets:
        for rate in rates:
            row = summarize(runs[(t.name, rate)], rate)
            if t.pids and row["ok"]:
                raw = cpu_on[(t.name, rate)]
                net = raw - sum(idle[p] for p in t.pids) * wall_on[(t.name, rate)]
                row["cpu_s_per_1000"] = 1000 * raw / row["ok"]
                row["cpu_net_s_per_1000"] = 1000 * net / row["ok"]
            rows[f"{t.name}@{rate:g}"] = row
    for t in targets:
        if t.name.startswith("direct"):
            continue
        for rate in rates:
            row, ref = rows[f"{t.name}@{rate:g}"], rows[f"{t.baseline}@{rate:g}"]
            row["baseline"] = t.baseline
            for m in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"):
                row[f"added_{m}"] = None if row[m] is None or ref[m] is None else row[m] - ref[m]
    for t in targets:
        sustained = [
            r for r in rates
            if rows[f"{t.name}@{r:g}"]["errors"] == 0
            and rows[f"{t.name}@{r:g}"]["achieved_rps"] >= 0.95 * rows[f"{t.name}@{r:g}"]["offered_rps"]
            and (rows[f"{t.name}@{r:g}"]["ttft_p99_ms"] or 1e9) <= args.ttft_bound_ms
        ]  # fmt: skip
        report.setdefault("max_sustained_rps", {})[t.name] = max(sustained) if sustained else None
    report["rows"] = rows
    report["targets"] = [{"name": t.name, "kind": t.kind, "baseline": t.baseline} for t in targets]
