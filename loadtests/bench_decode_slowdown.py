"""Decode slowdown from KV checkpoint streaming (DESIGN 4.4: streaming never slows a decode step).

    python -m loadtests.bench_decode_slowdown [--runs 5] [--requests 32] [--prompt 1024] [--output 256]

One in-process synthetic worker in real time (time_scale 1.0, Qwen3-8B on H100-80G, payload_scale
0.01: 94 KB of real bytes per 64-token page) decodes `--requests` concurrent requests; with
streaming ON every full page goes to a second in-process worker's checkpoint store (same event loop,
so the holder's receive work competes with the serving loop: a conservative setup), OFF sends
nothing. Runs alternate OFF/ON (the order flips each round). Per run: the decode-step wall time is
the gap between consecutive tokens of a request, counted only once every request has its first token
(so no prefill step is included); the run's figure is the median gap. Also reported: the step
loop's own CPU time per step (sleeps excluded) and the caller cost of `send_pages`. The table shows
the median over runs and the slowdown ON vs OFF (goal < 2%). Writes out/bench_decode_slowdown.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import logging
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import structlog
import uvloop

from gateway.protocol.generate import GenerateRequest, HolderRef, LumenExt, SamplingParams
from gateway.protocol.launch import EngineSpec
from gateway.protocol.planes import Member
from worker_hooks.engine.handle import RequestHandle
from worker_hooks.engine.service import Worker, start_worker

MODEL, GPU = "Qwen3-8B", "H100-80G"


def make_spec(worker_id: str, args: argparse.Namespace) -> EngineSpec:
    return EngineSpec(
        worker_id=worker_id,
        control_address="",
        model=MODEL,
        gpu=GPU,
        time_scale=1.0,
        page_size=64,
        max_running_requests=max(64, args.requests),
        ckpt_budget_bytes=256 << 30,  # modelled; 2.56 GiB of real pages at payload_scale 0.01
        ckpt_payload_scale=args.payload_scale,
        log_level="warning",
    )


async def _collect(handle: RequestHandle, stamps: list[tuple[float, int]]) -> None:
    """(arrival time, tokens) of every emission of one request."""
    while True:
        e = await handle.next()
        stamps.append((time.perf_counter(), len(e.new_ids)))
        if e.finish is not None:
            if e.finish.type == "abort":
                raise RuntimeError(f"{handle.rid} aborted: {e.finish.message}")
            return


async def one_run(a: Worker, b: Worker, on: bool, tag: str, args: argparse.Namespace) -> dict[str, Any]:
    holders = [HolderRef(worker_id=b.worker_id, kv_endpoint=b.kv_endpoint)] if on else []
    params = SamplingParams(max_new_tokens=args.output, temperature=0.0, ignore_eos=True)
    sender = a.engine.ckpt.sender
    if sender is not None:
        sender.reset_caller_cost()
    s0 = a.engine.stats()
    sent0 = a.engine.ckpt.stats().bytes_sent
    stamps: list[list[tuple[float, int]]] = [[] for _ in range(args.requests)]
    tasks = []
    for i in range(args.requests):
        # distinct prompts (no shared prefix) of staggered lengths, so pages complete on different steps
        prompt = [32 + (i * 31 + j * 7 + len(tag)) % 90 for j in range(args.prompt + 3 * i)]
        req = GenerateRequest(
            rid=f"{tag}-{i}",
            input_ids=prompt,
            sampling_params=params,
            lumen=LumenExt(checkpoint=holders),
        )
        tasks.append(asyncio.create_task(_collect(a.engine.submit(req), stamps[i])))
    await asyncio.gather(*tasks)
    s1 = a.engine.stats()
    all_first = max(s[0][0] for s in stamps)
    gaps = [t1 - t0 for s in stamps for (t0, _), (t1, _) in itertools.pairwise(s) if t0 >= all_first]
    cost = sender.caller_cost() if sender is not None else None
    held = b.engine.ckpt.stats()
    return {
        "mode": "on" if on else "off",
        "decode_step_ms_median": statistics.median(gaps) * 1e3,
        "decode_step_ms_mean": statistics.fmean(gaps) * 1e3,
        "decode_steps_measured": len(gaps),
        "loop_cpu_us_per_step": (s1.busy_s_total - s0.busy_s_total) / (s1.steps_total - s0.steps_total) * 1e6,
        "steps": s1.steps_total - s0.steps_total,
        "modelled_bytes_sent": a.engine.ckpt.stats().bytes_sent - sent0,
        "send_pages_calls": cost.calls if cost else 0,
        "send_pages_p50_us": cost.p50_us if cost else 0.0,
        "send_pages_p99_us": cost.p99_us if cost else 0.0,
        "holder_streams_left": held.streaming,
    }


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    async with start_worker(make_spec("serving", args)) as a, start_worker(make_spec("holder", args)) as b:
        # what the gateway's Members does: the two trust each other's CURVE keys on the KV plane
        members = [
            Member(w.worker_id, w.incarnation, w.engine.planes.keys.public, w.kv_endpoint) for w in (a, b)
        ]
        for w in (a, b):
            w.engine.planes.members.replace(members)
        decode_ms = a.engine.cost.decode_step_time([args.prompt + args.output // 2] * args.requests) * 1e3
        print(f"{MODEL}/{GPU}: modelled decode step ~{decode_ms:.2f} ms at batch {args.requests}")
        await one_run(a, b, False, "warmup", args)
        for rnd in range(args.runs):
            for on in (False, True) if rnd % 2 == 0 else (True, False):
                row = await one_run(a, b, on, f"r{rnd}{'on' if on else 'off'}", args)
                rows.append(row)
                print(
                    f"  run {rnd} {row['mode']:>3}: median step {row['decode_step_ms_median']:.3f} ms, "
                    f"loop CPU {row['loop_cpu_us_per_step']:.0f} us/step",
                    flush=True,
                )
                if on:  # the holder frees each request's pages on END; wait for it between runs
                    await asyncio.sleep(0.2)
    return {"rows": rows, "modelled_decode_step_ms": decode_ms}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("off", "on"):
        mine = [r for r in rows if r["mode"] == mode]
        out[mode] = {
            k: statistics.median(r[k] for r in mine)
            for k in ("decode_step_ms_median", "decode_step_ms_mean", "loop_cpu_us_per_step")
        }
        out[mode]["send_pages_p50_us"] = statistics.median(r["send_pages_p50_us"] for r in mine)
        out[mode]["send_pages_p99_us"] = statistics.median(r["send_pages_p99_us"] for r in mine)
        out[mode]["modelled_gib_sent_per_run"] = (
            statistics.median(r["modelled_bytes_sent"] for r in mine) / 2**30
        )
    off, on = out["off"]["decode_step_ms_median"], out["on"]["decode_step_ms_median"]
    out["slowdown_pct"] = (on / off - 1.0) * 100.0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="rounds; each has one OFF and one ON run")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens (request i adds 3i)")
    ap.add_argument("--output", type=int, default=256)
    ap.add_argument("--payload-scale", type=float, default=0.01)
    ap.add_argument("--out", default="out/bench_decode_slowdown.json")
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    result = uvloop.run(bench(args))
    summary = summarize(result["rows"])
    print()
    print(
        f"{'streaming':<10} {'step p50 ms':>12} {'step mean ms':>13} {'loop CPU us/step':>17} {'send_pages p50/p99 us':>22}"
    )
    for mode in ("off", "on"):
        s = summary[mode]
        print(
            f"{mode:<10} {s['decode_step_ms_median']:>12.3f} {s['decode_step_ms_mean']:>13.3f} "
            f"{s['loop_cpu_us_per_step']:>17.1f} {s['send_pages_p50_us']:>10.1f} / {s['send_pages_p99_us']:<9.1f}"
        )
    print(f"slowdown (median decode step, ON vs OFF): {summary['slowdown_pct']:+.2f}%  (goal < 2%)")
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    report = {
        "command": "python -m loadtests.bench_decode_slowdown "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "setup": {"model": MODEL, "gpu": GPU, "time_scale": 1.0, "page_size": 64, **vars(args)},
        "modelled_decode_step_ms": result["modelled_decode_step_ms"],
        "summary": summary,
        "rows": result["rows"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
