"""Side-by-side live runs: the same workload and seed against a fresh local cluster in each mode.

    python -m loadtests.sidebyside --modes stop_restart,fixed_checkpoint,lumen --out out/live-paper-4w

For every mode: one run with the fault schedule, and one run without it (the recovery-time
reference, EVALUATION.md). The schedule is `--fault KIND:TARGET@SECONDS[xFACTOR][+DURATION]`, repeated
(loadtests/faults.py: kill, hang, stall or slow; a worker id, random, busiest or top-holder), e.g.

    --fault slow:w1@5x4 --fault kill:top-holder@12 --fault kill:random@12

`--victims V1,V2` adds kills (`kill -9`) of those workers at `--kill-at`; with neither --fault nor
--victims, the scenario's first failure (kill or slow, on its workers) or else a kill of w0 strikes
at `--kill-at`, as before fault schedules. Recovery is measured from the first fault that fired. Metrics come from `gateway.core.evaluation`, the implementation the
simulator uses too. The gateway's /admin/workers is polled every `--poll` seconds during each run.
Writes summary.json (the same per-mode keys as `lumen sim`, plus the faults fired: time, kind,
resolved worker), summary.md, timelines.json (the polled worker queues and the faults of every run),
timeline.png (TTFT, TPOT and queued requests over time, faults and recovery marked) and
queues-MODE.png (running and waiting requests per worker in that mode's faulted run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
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
from loadtests.faults import FaultRunner, FaultSchedule, FaultSpecError, parse_fault

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


QUEUE_FIELDS = ("state", "running", "waiting", "ckpt_tokens")


async def poll_workers(
    http: aiohttp.ClientSession, url: str, t0: float, samples: list[dict[str, Any]], period_s: float
) -> None:
    """Append `{t, workers: {id: {state, running, waiting, ckpt_tokens}}}` every `period_s` until
    cancelled; a missed poll (gateway busy) is a gap, not an error."""
    next_at = time.monotonic()
    while True:
        try:
            async with http.get(f"{url}/admin/workers", timeout=aiohttp.ClientTimeout(total=5)) as resp:
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
    url: str,
    shapes: list[Shape],
    results: list[RequestResult],
    schedule: FaultSchedule,
    seed: int,
    poll_s: float,
) -> dict[str, Any]:
    info: dict[str, Any] = {"queue": []}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        t0 = time.monotonic()
        faults = FaultRunner(http, url, schedule, seed=seed, t0=t0)

        async def one(s: Shape, r: RequestResult) -> None:
            await asyncio.sleep(max(0.0, s.at - (time.monotonic() - t0)))
            await stream_completion(http, url, "lumen-synthetic", r)

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
        await asyncio.gather(*tasks)
        for t in side:
            t.cancel()
        await asyncio.gather(*side, return_exceptions=True)
        sys.stderr.write("\n")
        info["t0"] = t0
        info["faults"] = faults.fired
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
    mode: str, args: argparse.Namespace, shapes: list[Shape], schedule: FaultSchedule, log_dir: Path
) -> tuple[list[ev.RequestRecord], dict[str, Any]]:
    """One fresh cluster in `mode` under the load, `schedule` fired against it (empty: the reference)."""
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
    label = f"{mode}{'' if schedule else ' (no failure)'}"
    sys.stderr.write(f"[{label}] starting {args.workers} workers\n")
    with ClusterProcess(workers=args.workers, mode=mode, overrides=overrides, log_dir=log_dir) as c:
        info = asyncio.run(_drive(c.url, shapes, results, schedule, args.seed, args.poll))
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
    out: Path,
    summary: dict[str, Any],
    series: dict[str, list[ev.RequestRecord]],
    failure_at: float,
    timelines: dict[str, dict[str, Any]] | None = None,
) -> None:
    """summary.json, summary.md, timelines.json and (with matplotlib) timeline.png + queues-MODE.png.

    `timelines` is keyed like `series`: per run its polled worker `queue`, the `faults` fired, and for
    faulted runs `failure_at` and `recovery_time_s`."""
    timelines = timelines or {}
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if timelines:
        (out / "timelines.json").write_text(json.dumps(timelines))
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
    fired = [
        f"| {m} | {f['t']:.2f} | {f['mode']} | {f['target']} | {f['worker'] or '–'} | "
        f"{'ok' if f['ok'] else f['error']} |"
        for m, row in modes.items()
        for f in row.get("faults", [])
    ]
    if fired:
        lines += ["", "Faults fired (s into the load):", "", "| run | t | fault | target | worker | result |"]
        lines += ["|---|---|---|---|---|---|", *fired]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # plots are optional
        return
    schedule = [parse_fault(s) for s in summary.get("faults", [])]
    fig, axes = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    colors: dict[str, str] = {}
    for name, recs in series.items():
        metrics: tuple[ev.Metric, ...] = ("ttft", "tpot")
        for ax, metric in zip(axes[:2], metrics, strict=True):
            w = ev.window_means(recs, metric)
            pts = [(2.0 * k + 1.0, v) for k, v in enumerate(w) if v is not None]
            (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=name)
            colors[name] = line.get_color()
        samples = timelines.get(name, {}).get("queue", [])
        if samples:
            waiting = [sum(_queue(w, "waiting") for w in s["workers"].values()) for s in samples]
            axes[2].plot([s["t"] for s in samples], waiting, color=colors[name], label=name)
    for ax in axes:
        _mark_faults(ax, [(e.at, str(e)) for e in schedule], failure_at)
    for name, tl in timelines.items():
        rec = tl.get("recovery_time_s")
        if rec is not None:
            for ax in axes:
                ax.axvline(tl["failure_at"] + rec, color=colors.get(name, "green"), linestyle=":", lw=1.5)
            axes[0].text(
                tl["failure_at"] + rec,
                0.02,
                f" recovered ({name})",
                rotation=90,
                fontsize=7,
                color=colors.get(name, "green"),
                transform=axes[0].get_xaxis_transform(),
                va="bottom",
            )
    axes[0].set_ylabel("mean TTFT of 2 s window (s)")
    axes[0].set_yscale("log")
    axes[1].set_ylabel("mean TPOT of 2 s window (s)")
    axes[1].set_yscale("log")
    axes[2].set_ylabel("queued requests (all workers)")
    axes[2].set_xlabel("request arrival / poll time (s into the load)")
    axes[0].legend(fontsize=8)
    axes[0].set_title("Live side-by-side: TTFT, TPOT and queues over time (faults red, recovery dotted)")
    fig.tight_layout()
    fig.savefig(out / "timeline.png", dpi=110)
    plt.close(fig)
    for name, tl in timelines.items():
        if tl.get("faults") and tl.get("queue"):
            _plot_queues(plt, out / f"queues-{name}.png", name, tl)


def _queue(w: dict[str, Any], key: str) -> float:
    """A worker's polled count; NaN (a gap) once it failed, its last heartbeat's numbers are stale."""
    if w.get("state") in ("FAILED", "REMOVED"):
        return math.nan
    return float(w.get(key) or 0)


def _mark_faults(ax: Any, marks: list[tuple[float, str]], fallback_at: float) -> None:
    """Red vertical lines, one per instant, labelled with what struck then."""
    by_t: dict[float, list[str]] = {}
    for t, label in marks or [(fallback_at, "fault")]:
        by_t.setdefault(round(t, 2), []).append(label)
    for t, labels in by_t.items():
        ax.axvline(t, color="red", linestyle="--", lw=1)
        ax.text(
            t,
            0.98,
            " " + ", ".join(labels),
            rotation=90,
            fontsize=7,
            color="red",
            transform=ax.get_xaxis_transform(),
            va="top",
        )


def _plot_queues(plt: Any, path: Path, name: str, tl: dict[str, Any]) -> None:
    samples = tl["queue"]
    ids = sorted({wid for s in samples for wid in s["workers"]}, key=lambda w: (len(w), w))
    fig, axes = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    ts = [s["t"] for s in samples]
    for wid in ids:
        for ax, key in zip(axes, ("running", "waiting"), strict=True):
            ys = [_queue(s["workers"][wid], key) if wid in s["workers"] else math.nan for s in samples]
            ax.plot(ts, ys, label=wid, lw=1.2)
    marks = [
        (f["t"], f"{f['mode']} {f['worker']}" + (f" ({f['target']})" if f["target"] != f["worker"] else ""))
        for f in tl["faults"]
        if f["ok"]
    ]
    for ax in axes:
        _mark_faults(ax, marks, tl.get("failure_at", 0.0))
        rec = tl.get("recovery_time_s")
        if rec is not None:
            ax.axvline(tl["failure_at"] + rec, color="green", linestyle=":", lw=1.5, label="recovered")
    axes[0].set_ylabel("running requests")
    axes[1].set_ylabel("waiting requests")
    axes[1].set_xlabel("s into the load (/admin/workers polled)")
    axes[0].legend(fontsize=8, ncol=min(len(ids) + 1, 8))
    axes[0].set_title(f"{name}: per-worker queues (faults red, recovery dotted green)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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


def _failure_at(fired: list[dict[str, Any]], schedule: FaultSchedule) -> float:
    """When the first fault struck (recovery is measured from there); the planned time if none did."""
    struck = [f["t"] for f in fired if f["ok"] and f["undo_of"] is None]
    return min(struck) if struck else float(schedule.first_at or 0.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--scenario", help="take workers, model and its first failure from configs/scenarios/NAME.toml"
    )
    ap.add_argument("--modes", default="stop_restart,fixed_checkpoint,lumen")
    ap.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="KIND:TARGET@SECONDS[xFACTOR][+DURATION]",
        help="a fault event (repeat for more; same SECONDS: at once), e.g. slow:w1@5x4, hang:busiest@8+2, "
        "kill:top-holder@12, kill:random@12 (loadtests/faults.py)",
    )
    ap.add_argument(
        "--victims",
        help="workers killed at --kill-at (comma-separated; default w0, or the scenario's, when no --fault)",
    )
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--model", default="Qwen3-32B")
    ap.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals")
    ap.add_argument("--rate", type=float, default=6.0, help="requests per second")
    ap.add_argument("--scale", type=float, default=0.5, help="length scale of the conv-like workload")
    ap.add_argument("--kill-at", type=float, default=15.0)
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--max-running", type=int, default=16)
    ap.add_argument("--model-load-s", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=1, help="workload, and the draws of `random` fault targets")
    ap.add_argument("--poll", type=float, default=0.5, help="seconds between /admin/workers polls")
    ap.add_argument("--baseline-per-mode", action="store_true", help="a no-failure run for every mode")
    ap.add_argument("--out", default="out/sidebyside")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    sc = None
    if args.scenario:
        from gateway.sim.scenario import load_scenario

        sc = load_scenario(args.scenario)
        args.workers, args.model = sc.cluster.workers, sc.cluster.model
        # the scenario's rate is for modelled GPUs; a CPU box streams ~14 req/s per 4 workers at best
        args.rate = min(args.rate, 3.5 * args.workers)
    if not args.poll > 0:
        ap.error(f"--poll must be > 0, got {args.poll}")
    try:
        schedule = build_schedule(args.fault, args.victims, args.kill_at, args.workers, sc, args.seed)
    except FaultSpecError as exc:
        ap.error(str(exc))
    out = Path(args.out)
    shapes = conv_like(args.duration, args.rate, args.seed, args.scale)
    modes = [m for m in args.modes.split(",") if m]
    t_start = time.monotonic()
    summary: dict[str, Any] = {
        "workers": args.workers,
        "seed": args.seed,
        "requests": len(shapes),
        "args": vars(args),
        "faults": [str(e) for e in schedule.events],
        "machine": f"{platform.node()} {platform.machine()} py{platform.python_version()}",
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "date": time.strftime("%Y-%m-%d"),
        "modes": {},
    }
    series: dict[str, list[ev.RequestRecord]] = {}
    timelines: dict[str, dict[str, Any]] = {}
    shared_base: list[ev.RequestRecord] | None = None
    for mode in modes:
        if args.baseline_per_mode or shared_base is None:
            name = f"no failure ({mode})"
            base, base_info = run_mode(mode, args, shapes, FaultSchedule(), out / "logs" / f"{mode}-base")
            shared_base = base
            series[name] = base
            timelines[name] = {"queue": base_info["queue"], "faults": []}
        failed, info = run_mode(mode, args, shapes, schedule, out / "logs" / mode)
        series[mode] = failed
        failure_at = _failure_at(info["faults"], schedule)
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
        row["failure_at_s"] = failure_at
        row["faults"] = [{k: v for k, v in f.items() if k != "snapshot"} for f in info["faults"]]
        summary["modes"][mode] = row
        timelines[mode] = {
            "queue": info["queue"],
            "faults": info["faults"],
            "failure_at": failure_at,
            "recovery_time_s": row["recovery_time_s"],
        }
        print(
            f"{mode}: " + ", ".join(f"{k}={_fmt(row[k])}" for k in (*SUMMARY_KEYS, "client_errors")),
            flush=True,
        )
    summary["simulated_s"] = None
    summary["wall_s"] = time.monotonic() - t_start
    write_report(out, summary, series, float(schedule.first_at or args.kill_at), timelines)
    print((out / "summary.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
