"""The overhead bench's measurement: one Lumen cluster and SMG in front of its workers, every path
driven at every rate (rotating order), gateway CPU accounted from /proc, and the samples turned into
rows: percentiles, added latency vs the path's baseline, CPU per 1,000 requests, max sustained rate."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from gateway.protocol.secrets import TOKEN_ENV, admin_headers, generate_token, worker_http_bearer
from loadtests.bench_smg.drive import Sample, Target, cpu_seconds, drive, workload
from loadtests.bench_smg.report import sustained
from loadtests.bench_smg.smg_process import Smg, probe, smg_binary
from loadtests.cluster_proc import ClusterProcess


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs from /proc/stat (busy: all but idle and iowait)."""
    f = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(f) - f[3] - f[4], sum(f)


async def _busy_over(seconds: float) -> float:
    """Cores the whole machine kept busy over the next `seconds`."""
    m0 = machine_cpu()
    await asyncio.sleep(seconds)
    m1 = machine_cpu()
    return (m1[0] - m0[0]) / (m1[1] - m0[1]) * (os.cpu_count() or 1) if m1[1] > m0[1] else 0.0


async def _quiet(max_busy: float, max_wait_s: float) -> tuple[float, float]:
    """The machine's busy cores over 1 s before a step, and the seconds waited for it to fall to
    `max_busy` (0: no waiting), at most `max_wait_s`; the bench's own idle processes count too."""
    t0 = time.monotonic()
    busy = await _busy_over(1.0)
    while max_busy > 0 and busy > max_busy and time.monotonic() - t0 < max_wait_s:
        await asyncio.sleep(2.0)
        busy = await _busy_over(1.0)
    waited = time.monotonic() - t0 - 1.0
    return busy, waited if waited > 0.5 else 0.0


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x:.1f} ms"


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


def lumen_names(n: int) -> tuple[str, str]:
    """The Lumen paths of the n-gateway cluster: `/v1/completions` and `/generate` (unsuffixed for one)."""
    return ("lumen", "lumen_gen") if n == 1 else (f"lumen_x{n}", f"lumen_gen_x{n}")


def gateway_counts(spec: str) -> list[int]:
    """`--lumen-gateways 1,2` → [1, 2]: one Lumen cluster per entry, in that order, no repeats."""
    out: list[int] = []
    for x in spec.split(","):
        n = int(x)
        if n < 1:
            raise ValueError(f"--lumen-gateways: {n} is not a gateway count")
        if n not in out:
            out.append(n)
    if not out:
        raise ValueError("--lumen-gateways: no gateway count")
    return out


async def run(args: argparse.Namespace, report: dict[str, Any]) -> None:
    rates = [float(x) for x in args.rates.split(",")]
    counts = gateway_counts(args.lumen_gateways)
    overrides: dict[str, Any] = {"engine.time_scale": args.time_scale, "gateway.log_level": "warning"}
    for kv in args.set:
        key, _, value = kv.partition("=")
        overrides[key] = tomllib.loads(f"v = {value}")["v"]
    log_dir = Path(args.out).with_suffix("")
    log_dir.mkdir(parents=True, exist_ok=True)
    exe, smg_info = smg_binary(not args.no_install) if args.smg else (None, "skipped (--no-smg)")
    report["smg"] = {"version_or_reason": smg_info}
    smg: Smg | None = None
    # the clusters' control token, chosen here: Lumen's workers take HTTP requests only with the bearer
    # derived from it, which the direct paths and SMG (`--api-key`) then present
    token = generate_token()
    bearer = worker_http_bearer(token)
    with contextlib.ExitStack() as stack:
        # one Lumen cluster per gateway count, each with its own `--workers` workers (same config);
        # direct and SMG use the first cluster's workers. n > 1: all n gateways accept on one port.
        clusters: dict[int, ClusterProcess] = {}
        for n in counts:
            clusters[n] = stack.enter_context(
                ClusterProcess(
                    workers=args.workers, mode=args.mode, overrides=overrides,
                    log_dir=log_dir / f"lumen-x{n}", gateways=n, shared_port=n > 1, env={TOKEN_ENV: token},
                )
            )  # fmt: skip
        report["lumen_clusters"] = {
            str(n): {k: c.ready.get(k) for k in ("urls", "gateway_pids", "workers", "logs")} | {"cmd": c.cmd}
            for n, c in clusters.items()
        }
        first = clusters[counts[0]]
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=300)) as http:
            async with http.get(
                first.url + "/admin/workers", headers=admin_headers(first.url + "/admin/workers")
            ) as r:
                workers = await r.json()
            worker_urls = [w["url"] for w in workers]
            async with http.get(first.url + "/v1/models") as r:
                lumen_model = (await r.json())["data"][0]["id"]
            targets = [
                Target("direct", worker_urls, "generate", api_key=bearer),
                Target("direct_oai", worker_urls, "completions", lumen_model, True, api_key=bearer),
            ]
            for n, c in clusters.items():
                # the gateway processes' CPU (the cluster process itself only supervises)
                gw = c.ready.get("gateway_pids") or [c.proc.pid if c.proc else 0]
                pids = {"lumen": gw[0]} if n == 1 else {f"lumen_x{n}/g{i}": p for i, p in enumerate(gw)}
                name, gen_name = lumen_names(n)
                targets.append(Target(name, [c.url], "completions", model=lumen_model, pids=pids))
                if args.lumen_generate:
                    targets.append(Target(gen_name, [c.url], "generate", pids=pids))
            try:
                if exe is not None:
                    smg = Smg(exe, worker_urls, args.smg_policy, log_dir / "smg.log", bearer)
                    await smg.ready(http)
                    auth = {"Authorization": f"Bearer {bearer}"}  # SMG's --api-key guards its clients too
                    async with http.get(smg.url + "/v1/models", headers=auth) as r:
                        smg_model = (await r.json())["data"][0]["id"]
                    found = await probe(http, smg.url, smg_model, bearer)
                    report["smg"]["probe"] = found
                    report["smg"]["cmd"] = " ".join(smg.cmd).replace(bearer, "<worker bearer>")
                    print(f"SMG probe against the workers: {json.dumps(found)}", file=sys.stderr)
                    smg_pids = {"smg": smg.proc.pid}
                    if found["/v1/completions"]["ok"]:
                        targets.append(
                            Target(
                                "smg",
                                [smg.url],
                                "completions",
                                smg_model,
                                True,
                                smg_pids,
                                "direct_oai",
                                bearer,
                            )
                        )
                    if found["/generate"]["ok"] and args.smg_generate:
                        targets.append(
                            Target("smg_gen", [smg.url], "generate", pids=smg_pids, api_key=bearer)
                        )
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
    busy_on: dict[tuple[str, float], list[float]] = {}  # machine CPU busy (cores) during each run
    before_on: dict[tuple[str, float], list[float]] = {}  # the same over 1 s just before it
    waited_s = 0.0
    client_on: dict[tuple[str, float], float] = {}  # this process's CPU seconds (the load generator)
    split_on: dict[tuple[str, float], dict[str, float]] = {}  # gateway CPU seconds per process
    k = 0
    for rep in range(args.repeats):
        for rate in rates:
            shapes = workload(rate, args.seconds, args.min_requests, args.seed + int(rate * 1000) + rep)
            order = targets[k % len(targets) :] + targets[: k % len(targets)]
            k += 1
            for t in order:
                before, waited = await _quiet(args.wait_quiet, args.wait_quiet_max_s)
                c0 = {p: cpu_seconds(pid) for p, pid in all_pids.items()}
                m0, p0 = machine_cpu(), time.process_time()
                w0 = time.monotonic()
                samples, t0 = await drive(http, t, shapes)
                wall = time.monotonic() - w0
                key = (t.name, rate)
                m1 = machine_cpu()
                busy = (m1[0] - m0[0]) / (m1[1] - m0[1]) * (os.cpu_count() or 1) if m1[1] > m0[1] else 0.0
                busy_on.setdefault(key, []).append(busy)
                before_on.setdefault(key, []).append(before)
                waited_s += waited
                client_on[key] = client_on.get(key, 0.0) + time.process_time() - p0
                for p, pid in all_pids.items():
                    d = cpu_seconds(pid) - c0[p]
                    side = "on" if p in t.pids else "off"
                    acct[p][f"{side}_cpu"] += d
                    acct[p][f"{side}_wall"] += wall
                    if p in t.pids:
                        cpu_on[key] = cpu_on.get(key, 0.0) + d
                        split_on.setdefault(key, {})[p] = split_on.get(key, {}).get(p, 0.0) + d
                wall_on[key] = wall_on.get(key, 0.0) + wall
                runs.setdefault(key, []).append((samples, t0))
                step = summarize([(samples, t0)], rate)
                gw = f", gateway {sum(split_on.get(key, {}).values()) / wall:.2f} core" if t.pids else ""
                print(
                    f"rep {rep + 1} rate {rate:g}/s {t.name}: {len(samples)} req, {step['errors']} errors, "
                    f"achieved {step['achieved_rps']:.1f}/s, TTFT p99 {_ms(step['ttft_p99_ms'])}, "
                    f"{wall:.1f} s; machine {busy:.2f} of {os.cpu_count()} cores busy{gw} "
                    f"({before:.2f} just before{f', after waiting {waited:.0f} s' if waited else ''})",
                    file=sys.stderr,
                    flush=True,
                )
    report["waited_for_quiet_s"] = waited_s
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
            key = (t.name, rate)
            wall = wall_on[key]
            row["machine_busy_cores"] = float(np.mean(busy_on[key]))
            row["machine_busy_before_cores"] = before_on[key]
            row["client_cpu_cores"] = client_on[key] / wall
            if t.pids:
                row["gateway_cpu_cores"] = cpu_on[key] / wall
                if len(t.pids) > 1:  # how the kernel spread the connections over the shared port
                    row["gateway_cpu_split"] = {p: c / wall for p, c in split_on[key].items()}
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
        ok = [r for r in rates if sustained(rows[f"{t.name}@{r:g}"], args.ttft_bound_ms)]
        report.setdefault("max_sustained_rps", {})[t.name] = max(ok) if ok else None
    report["rows"] = rows
    report["targets"] = [{"name": t.name, "kind": t.kind, "baseline": t.baseline} for t in targets]
