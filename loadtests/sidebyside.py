"""Side-by-side live runs: the same workload and seed against a fresh local cluster in each mode.

    python -m loadtests.sidebyside --modes stop_restart,fixed_checkpoint,lumen --out out/live-paper-4w

For every mode: one run where worker w0 is killed (`kill -9`) at `--kill-at` seconds into the load,
and one run without the failure (the recovery-time reference, EVALUATION.md). Metrics come from
`gateway.core.evaluation`, the implementation the simulator uses too. Writes summary.json (the same
per-mode keys as `lumen sim`), summary.md and timeline.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from gateway.core import evaluation as ev
from gateway.sim.workload import synthetic
from loadtests.client import RequestResult, stream_completion
from loadtests.cluster_proc import ClusterProcess

SUMMARY_KEYS = ("ttft_mean_s", "tpot_mean_s", "recovery_time_s", "impact_ttft_mean_s", "impact_tpot_mean_s")


@dataclass(frozen=True, slots=True)
class Shape:
    at: float  # seconds after the load starts
    prompt_tokens: int
    output_tokens: int


def conv_like(duration_s: float, rate: float, seed: int, scale: float) -> list[Shape]:
    """Poisson arrivals with the Azure-conv length fit the simulator uses (`gateway.sim.workload`),
    lengths multiplied by `scale` to fit a CPU box."""
    wl = synthetic(np.random.default_rng(seed), rate, duration_s)
    return [
        Shape(float(t), max(8, int(p * scale)), max(4, int(o * scale)))
        for t, p, o in zip(wl.arrivals, wl.prompts, wl.outputs, strict=True)
    ]


def _results(shapes: list[Shape], seed: int) -> list[RequestResult]:
    rnd = random.Random(seed + 1)
    return [
        RequestResult(
            i, 0.0, [rnd.randrange(32, 127) for _ in range(s.prompt_tokens)], s.output_tokens, 0.0, None
        )
        for i, s in enumerate(shapes)
    ]


async def _drive(
    url: str, shapes: list[Shape], results: list[RequestResult], kill_at: float | None, victims: list[str]
) -> dict[str, Any]:
    info: dict[str, Any] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        t0 = time.monotonic()

        async def one(s: Shape, r: RequestResult) -> None:
            await asyncio.sleep(max(0.0, s.at - (time.monotonic() - t0)))
            await stream_completion(http, url, "lumen-synthetic", r)

        async def killer() -> None:
            assert kill_at is not None
            await asyncio.sleep(max(0.0, kill_at - (time.monotonic() - t0)))
            info["kill_wall"] = time.monotonic() - t0
            for victim in victims:
                async with http.post(f"{url}/admin/workers/{victim}/kill?mode=kill") as resp:
                    info.setdefault("kill", []).append(await resp.json())

        async def progress() -> None:
            while True:
                await asyncio.sleep(2.0)
                done = sum(1 for r in results if r.finish_reason or r.error)
                sys.stderr.write(f"\r  t={time.monotonic() - t0:5.1f}s  done {done}/{len(results)}  ")
                sys.stderr.flush()

        tasks = [asyncio.create_task(one(s, r)) for s, r in zip(shapes, results, strict=True)]
        side = [asyncio.create_task(progress())]
        if kill_at is not None:
            side.append(asyncio.create_task(killer()))
        await asyncio.gather(*tasks)
        for t in side:
            t.cancel()
        await asyncio.gather(*side, return_exceptions=True)
        sys.stderr.write("\n")
        info["t0"] = t0
        async with http.get(f"{url}/admin/sessions") as resp:
            info["sessions"] = await resp.json()
        async with http.get(f"{url}/admin/workers") as resp:
            info["workers"] = await resp.json()
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
    mode: str, args: argparse.Namespace, shapes: list[Shape], kill: bool, log_dir: Path
) -> tuple[list[ev.RequestRecord], dict[str, Any]]:
    from gateway.cli import parse_set

    overrides = {
        "engine.time_scale": args.time_scale,
        "engine.max_running_requests": args.max_running,
        "engine.model_load_s": args.model_load_s,
        "gateway.log_level": "warning",
        "model.preset": args.model,
        **parse_set(args.set),
    }
    results = _results(shapes, args.seed)
    label = f"{mode}{'' if kill else ' (no failure)'}"
    sys.stderr.write(f"[{label}] starting {args.workers} workers\n")
    with ClusterProcess(workers=args.workers, mode=mode, overrides=overrides, log_dir=log_dir) as c:
        victims = args.victims.split(",")
        info = asyncio.run(_drive(c.url, shapes, results, args.kill_at if kill else None, victims))
    interrupted = {i["rid"] for i in info["sessions"]["interrupted"]}
    records = _records(results, info["t0"], interrupted)
    info["restores"] = sum(1 for i in info["sessions"]["interrupted"] if i.get("restored_tokens"))
    info["replays"] = len(info["sessions"]["interrupted"]) - info["restores"]
    info["restored_tokens"] = sum(i.get("restored_tokens", 0) for i in info["sessions"]["interrupted"])
    drafted = sum(w.get("drafted_tokens", 0) for w in info["workers"])
    accepted = sum(w.get("accepted_tokens", 0) for w in info["workers"])
    info["draft_tokens_verified"] = drafted
    info["draft_accepted_fraction"] = accepted / drafted if drafted else None
    return records, info


def summarize(
    failed: list[ev.RequestRecord], base: list[ev.RequestRecord], failure_at: float
) -> dict[str, Any]:
    rec = ev.recovery_time(failed, base, failure_at, "ttft")
    rec_tpot = ev.recovery_time(failed, base, failure_at, "tpot")
    impact = ev.failure_impact(failed, failure_at, rec)
    out = ev.outcomes(failed)
    return {
        "ttft_mean_s": ev.mean_metric(failed, "ttft"),
        "tpot_mean_s": ev.mean_metric(failed, "tpot"),
        "recovery_time_s": rec,
        "recovery_time_tpot_s": rec_tpot,
        "impact_ttft_mean_s": impact.mean_ttft,
        "impact_tpot_mean_s": impact.mean_tpot,
        "impact_requests": impact.requests,
        "client_errors": out.errors,
        "requests": out.total,
        "interrupted": out.interrupted,
        "no_failure_ttft_mean_s": ev.mean_metric(base, "ttft"),
        "no_failure_tpot_mean_s": ev.mean_metric(base, "tpot"),
    }


def _fmt(v: object) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


def write_report(
    out: Path, summary: dict[str, Any], series: dict[str, list[ev.RequestRecord]], failure_at: float
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    modes = summary["modes"]
    cols = [
        "ttft_mean_s",
        "tpot_mean_s",
        "recovery_time_s",
        "impact_ttft_mean_s",
        "impact_tpot_mean_s",
        "client_errors",
        "interrupted",
        "restores",
        "replays",
        "restored_tokens",
    ]
    lines = ["| mode | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for m, row in modes.items():
        lines.append(f"| {m} | " + " | ".join(_fmt(row.get(c)) for c in cols) + " |")
    ref = modes.get("stop_restart")
    if ref:
        lines += [
            "",
            "Ratios to stop_restart (lower is better):",
            "",
            "| mode | TTFT | TPOT | recovery | impact TTFT |",
            "|---|---|---|---|---|",
        ]
        for m, row in modes.items():

            def ratio(k: str, row: dict[str, Any] = row) -> str:
                a, b = row.get(k), ref.get(k)
                return f"{a / b:.2f}" if isinstance(a, float) and isinstance(b, float) and b > 0 else "–"

            lines.append(
                f"| {m} | {ratio('ttft_mean_s')} | {ratio('tpot_mean_s')} | {ratio('recovery_time_s')} | "
                f"{ratio('impact_ttft_mean_s')} |"
            )
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional
        return
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for name, recs in series.items():
        w = ev.window_means(recs, "ttft")
        pts = [(2.0 * k + 1.0, v) for k, v in enumerate(w) if v is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=name)
    ax.axvline(failure_at, color="red", linestyle="--", label="worker killed")
    ax.set_xlabel("request arrival (s into the load)")
    ax.set_ylabel("mean TTFT of 2 s window (s)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("Live side-by-side: TTFT over time")
    fig.tight_layout()
    fig.savefig(out / "timeline.png", dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", help="take workers, model and victims from configs/scenarios/NAME.toml")
    ap.add_argument("--modes", default="stop_restart,fixed_checkpoint,lumen")
    ap.add_argument("--victims", default="w0", help="workers killed at --kill-at (comma-separated)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--model", default="Qwen3-32B")
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals")
    ap.add_argument("--rate", type=float, default=6.0, help="requests per second")
    ap.add_argument("--scale", type=float, default=0.5, help="length scale of the conv-like workload")
    ap.add_argument("--kill-at", type=float, default=15.0)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--max-running", type=int, default=16)
    ap.add_argument("--model-load-s", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--baseline-per-mode", action="store_true", help="a no-failure run for every mode")
    ap.add_argument("--out", default="out/sidebyside")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    if args.scenario:
        from gateway.sim.scenario import load_scenario

        sc = load_scenario(args.scenario)
        args.workers, args.model = sc.cluster.workers, sc.cluster.model
        first = sc.victims(args.seed)[0] if sc.failures else []
        args.victims = ",".join(first) or args.victims
        # the scenario's rate is for modelled GPUs; a CPU box streams ~14 req/s per 4 workers at best
        args.rate = min(args.rate, 3.5 * args.workers)
    out = Path(args.out)
    shapes = conv_like(args.duration, args.rate, args.seed, args.scale)
    modes = [m for m in args.modes.split(",") if m]
    t_start = time.monotonic()
    summary: dict[str, Any] = {
        "workers": args.workers,
        "seed": args.seed,
        "requests": len(shapes),
        "args": vars(args),
        "machine": f"{platform.node()} {platform.machine()} py{platform.python_version()}",
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "date": time.strftime("%Y-%m-%d"),
        "modes": {},
    }
    series: dict[str, list[ev.RequestRecord]] = {}
    shared_base: list[ev.RequestRecord] | None = None
    for mode in modes:
        if args.baseline_per_mode or shared_base is None:
            base, _ = run_mode(mode, args, shapes, kill=False, log_dir=out / "logs" / f"{mode}-base")
            shared_base = base
            series[f"no failure ({mode})"] = base
        failed, info = run_mode(mode, args, shapes, kill=True, log_dir=out / "logs" / mode)
        series[mode] = failed
        failure_at = float(info.get("kill_wall", args.kill_at))
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
                )
            }
        )
        summary["modes"][mode] = row
        print(
            f"{mode}: " + ", ".join(f"{k}={_fmt(row[k])}" for k in (*SUMMARY_KEYS, "client_errors")),
            flush=True,
        )
    summary["simulated_s"] = None
    summary["wall_s"] = time.monotonic() - t_start
    write_report(out, summary, series, args.kill_at)
    print((out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
