"""Policy cost: routing, holder choice and recovery dispatch decision time at cluster scale.

    python -m loadtests.bench_policy --workers 64 --inflight 10000 --decisions 20000

Builds a ClusterView of `--workers` HEALTHY workers carrying `--inflight` requests (conv-like
lengths, Llama-3-70B/H100 TP4 KV sizes, each worker's requests split into a running batch of at most
`--max-running` and a waiting queue). Every in-flight request is given a holder by the policy itself
(`choose_holders` + `with_assignment`, untimed), so holders' checkpoint tokens are what the policy
would have produced. Then, in steady state (each timed decision for a new request is paired with the
release of the oldest one, untimed), every call is timed alone with `time.perf_counter_ns`:

- `route`: `choose_worker` (where a new request goes);
- `holders`: `choose_holders` alone; `holders+assign`: `choose_holders` and `with_assignment` for
  each chosen holder (the decision the shell makes per request, the goal's figure); the same with
  two replicas and four failure domains excluded from the serving one, and with the ring placement.
  The request's lengths are drawn before the clock starts;
- `view_rebuild`: rebuilding a 64-worker view with one `dataclasses.replace` per worker (what the
  shell's checkpoint manager did before each choice until it kept its view incrementally), for scale;
- `dispatch/<rule>`: `dispatch` for requests of one FAILED worker, per rule. The view is the fleet's
  with that worker FAILED, made as the shell makes its views: `ClusterView.with_workers`, which
  carries the view's ranked load table over (untimed; its cost is the `view_update` context row).

Context rows (no goal; reported apart): `view_update` (`with_workers` of one changed worker: what the
shell's view costs per heartbeat or assignment now) and `dispatch/threshold cold view` (`dispatch`
on a view built from scratch, which ranks the survivors inside the timed call).

Rows are interleaved over `--repeats` rounds and pooled. Goal: p99 < 50 µs per decision. Any row
over it is profiled with cProfile and its hot spots printed.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import io
import json
import os
import platform
import pstats
import random
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from gateway.core.costmodel import CostModel
from gateway.core.dispatch import DispatchParams, InterruptedRequest, dispatch
from gateway.core.health import WorkerState
from gateway.core.holders import HolderParams, choose_holders, with_assignment
from gateway.core.modes import DispatchRule, Placement
from gateway.core.router import choose_worker
from gateway.core.types import ClusterView, LoadParams, WorkerView

GiB = 1024**3
GOAL_P99_US = 50.0


@dataclasses.dataclass(slots=True)
class Fleet:
    """The mutable state the benchmark keeps around its (immutable) view."""

    view: ClusterView
    kv_bytes_per_token: int
    # (holders, tokens) of every in-flight request, oldest first
    inflight: deque[tuple[tuple[str, ...], int]]
    rnd: random.Random

    def request_tokens(self, rnd: random.Random | None = None) -> tuple[int, int]:
        """(context, remaining) of a conv-like request (Azure conv trace lognormals)."""
        rnd = rnd or self.rnd
        prompt = int(min(4142, max(16, rnd.lognormvariate(6.93, 0.77))))
        output = int(min(601, max(8, rnd.lognormvariate(4.86, 0.93))))
        done = rnd.randrange(output)
        return prompt + done, output - done

    def assign(self, serving: str, params: HolderParams, lengths: tuple[int, int] | None = None) -> None:
        context, remaining = lengths or self.request_tokens()
        tokens = context + remaining
        chosen = choose_holders(self.view, serving, tokens * self.kv_bytes_per_token, params)
        for h in chosen:
            self.view = with_assignment(self.view, h, tokens, tokens * self.kv_bytes_per_token)
        self.inflight.append((chosen, tokens))

    def release_oldest(self) -> None:
        chosen, tokens = self.inflight.popleft()
        for h in chosen:
            self.view = with_assignment(self.view, h, -tokens, -tokens * self.kv_bytes_per_token)


def build_fleet(args: argparse.Namespace, params: HolderParams) -> Fleet:
    rnd = random.Random(args.seed)
    cost = CostModel.preset(args.model, args.gpu)
    per_worker = np.bincount(
        [rnd.randrange(args.workers) for _ in range(args.inflight)], minlength=args.workers
    )
    workers = []
    for i, n in enumerate(per_worker):
        running = min(int(n), args.max_running)
        workers.append(
            WorkerView(
                id=f"w{i}",
                state=WorkerState.HEALTHY,
                incarnation=1,
                running=running,
                waiting=int(n) - running,
                pending=rnd.randrange(4),
                kv_tokens_used=running * 1300,
                kv_capacity_tokens=cost.kv_capacity_tokens(),
                ckpt_budget_bytes=args.budget_gib * GiB,
                failure_domain=f"d{i % args.domains}",
            )
        )
    fleet = Fleet(ClusterView.of(workers), cost.model.kv_bytes_per_token, deque(), rnd)
    ids = list(fleet.view.workers)
    for _ in range(args.inflight):
        fleet.assign(rnd.choice(ids), params)
    return fleet


Thunk = Callable[[], object]


def row_makers(
    fleet: Fleet, load: LoadParams, cost: CostModel, failed: str
) -> dict[str, Callable[[], Thunk]]:
    """Per row: a function that does the untimed setup of one decision and returns the timed call."""
    ids = list(fleet.view.workers)
    rnd = fleet.rnd
    base = HolderParams(load=load)

    def route() -> Thunk:
        return lambda: choose_worker(fleet.view, load)

    def holders() -> Thunk:
        serving, (ctx, rem) = rnd.choice(ids), fleet.request_tokens()
        need = (ctx + rem) * fleet.kv_bytes_per_token
        return lambda: choose_holders(fleet.view, serving, need, base)

    def assigning(params: HolderParams) -> Callable[[], Thunk]:
        def make() -> Thunk:
            fleet.release_oldest()  # steady state: one request ends as another starts
            serving, lengths = rnd.choice(ids), fleet.request_tokens()
            return lambda: fleet.assign(serving, params, lengths)

        return make

    def view_rebuild() -> Thunk:
        extra = {wid: rnd.randrange(1000) for wid in ids}
        return lambda: ClusterView(
            {
                wid: dataclasses.replace(w, ckpt_tokens=w.ckpt_tokens + extra[wid])
                for wid, w in fleet.view.workers.items()
            }
        )

    # the context rows draw from their own generator, so that the fleet evolves as without them
    side = random.Random(1)

    def view_update() -> Thunk:
        wid = side.choice(ids)
        w = fleet.view.workers[wid]
        changed = dataclasses.replace(w, pending=w.pending + 1)  # one more request routed there
        return lambda: fleet.view.with_workers((changed,))

    def dispatching(rule: DispatchRule, cold: bool = False) -> Callable[[], Thunk]:
        params = DispatchParams(load=load, rule=rule)

        def make() -> Thunk:
            # a failure: `failed` is FAILED; one of its in-flight requests resumes elsewhere
            w = fleet.view.workers[failed]
            dead = dataclasses.replace(w, state=WorkerState.FAILED)
            if cold:  # a view made from scratch: no derived tables
                down = ClusterView({**fleet.view.workers, failed: dead})
            else:
                down = fleet.view.with_workers((dead,))
            r = side if cold else rnd
            ctx, rem = fleet.request_tokens(r)
            held, _ = fleet.inflight[r.randrange(len(fleet.inflight))]
            req = InterruptedRequest(
                rid="r",
                failed_worker=failed,
                holders=held,
                durable_tokens=r.randrange(ctx + 1),
                context_tokens=ctx,
                remaining_tokens=rem,
            )
            return lambda: dispatch(down, req, params, cost)

        return make

    return {
        "route": route,
        "holders": holders,
        "holders+assign": assigning(base),
        "holders+assign r=2 domains": assigning(
            HolderParams(load=load, replicas=2, exclude_failure_domain=True)
        ),
        "holders+assign ring": assigning(HolderParams(load=load, placement=Placement.RING)),
        "view_rebuild": view_rebuild,
        "dispatch/threshold": dispatching(DispatchRule.THRESHOLD),
        "dispatch/cost": dispatching(DispatchRule.COST),
        "dispatch/always_holder": dispatching(DispatchRule.ALWAYS_HOLDER),
        # context rows (CONTEXT_ROWS)
        "view_update": view_update,
        "dispatch/threshold cold view": dispatching(DispatchRule.THRESHOLD, cold=True),
    }


# rows timed for context only: no goal, reported in their own table
CONTEXT_ROWS = ("view_update", "dispatch/threshold cold view")


def time_row(make: Callable[[], Thunk], n: int) -> tuple[list[int], list[int]]:
    """`n` decisions timed one by one: wall ns (perf_counter) and this thread's CPU ns for each.

    The CPU clock brackets the wall clock, so it never adds to the wall figure; on a shared machine
    the gap between the two is time the thread was preempted.
    """
    wall, cpu = [], []
    for _ in range(n):
        thunk = make()
        c0 = time.thread_time_ns()
        t0 = time.perf_counter_ns()
        thunk()
        t1 = time.perf_counter_ns()
        cpu.append(time.thread_time_ns() - c0)
        wall.append(t1 - t0)
    return wall, cpu


def profile_row(make: Callable[[], Thunk], n: int) -> str:
    """cProfile of `n` decisions of one row (setup excluded), top functions by own time."""
    prof = cProfile.Profile()
    for _ in range(n):
        thunk = make()
        prof.enable()
        thunk()
        prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
    return buf.getvalue()


def summarize(samples: list[int]) -> dict[str, Any]:
    us = np.asarray(samples, dtype=np.float64) / 1000.0
    return {
        "n": len(samples),
        "p50_us": float(np.percentile(us, 50)),
        "p99_us": float(np.percentile(us, 99)),
        "max_us": float(us.max()),
        "mean_us": float(us.mean()),
    }


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=64)
    ap.add_argument("--inflight", type=int, default=10_000)
    ap.add_argument("--decisions", type=int, default=12_000, help="timed decisions per row and round")
    ap.add_argument("--repeats", type=int, default=3, help="rounds (rows interleaved, samples pooled)")
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--domains", type=int, default=4, help="failure domains (workers round-robin)")
    ap.add_argument("--budget-gib", type=int, default=128, help="checkpoint budget per holder")
    ap.add_argument("--model", default="Llama-3-70B")
    ap.add_argument("--gpu", default="H100-80G")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--profile-decisions", type=int, default=5000)
    ap.add_argument(
        "--gc",
        choices=("on", "freeze", "off"),
        default="on",
        help="freeze: gc.freeze() after building the fleet",
    )
    ap.add_argument("--out", default="out/bench_policy.json")
    args = ap.parse_args(argv)
    if args.workers < 2 or args.inflight < 1 or args.decisions < 1:
        ap.error("need --workers >= 2, --inflight >= 1, --decisions >= 1")

    load = LoadParams(nominal_batch=args.max_running)
    cost = CostModel.preset(args.model, args.gpu)
    t0 = time.monotonic()
    fleet = build_fleet(args, HolderParams(load=load))
    print(
        f"built {args.workers} workers / {args.inflight} in flight in {time.monotonic() - t0:.1f} s",
        file=sys.stderr,
    )
    if args.gc == "freeze":  # the fleet and its 10k in-flight records leave the collector's scans
        gc.collect()
        gc.freeze()
    elif args.gc == "off":
        gc.disable()
    failed = "w7" if args.workers > 7 else "w1"
    makers = row_makers(fleet, load, cost, failed)
    pooled: dict[str, list[int]] = {}
    per_round_p99: dict[str, list[float]] = {}
    pooled_cpu: dict[str, list[int]] = {}
    for rnd_i in range(args.repeats):
        for row, make in makers.items():
            if args.gc == "on":
                gc.collect()
            ns, cpu = time_row(make, args.decisions)
            pooled_cpu.setdefault(row, []).extend(cpu)
            pooled.setdefault(row, []).extend(ns)
            per_round_p99.setdefault(row, []).append(float(np.percentile(ns, 99)) / 1000.0)
        print(f"round {rnd_i + 1}/{args.repeats} done", file=sys.stderr)

    ckpt = [w.ckpt_bytes / max(1, w.ckpt_budget_bytes) for w in fleet.view.workers.values()]
    report: dict[str, Any] = {
        "command": "python -m loadtests.bench_policy " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores py{platform.python_version()}",
        "loadavg_at_start": os.getloadavg(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d"),
        "commit": _commit(),
        "args": vars(args),
        "fleet": {
            "budget_used_min": min(ckpt),
            "budget_used_max": max(ckpt),
            "holder_balance": max(w.ckpt_tokens for w in fleet.view.workers.values())
            / max(1, min(w.ckpt_tokens for w in fleet.view.workers.values())),
        },
        "goal_p99_us": GOAL_P99_US,
        "rows": {},
        "context_rows": {},
        "profiles": {},
    }
    print(
        f"\nPolicy decision time, {args.workers} workers, {args.inflight} in flight, "
        f"{args.repeats} x {args.decisions} decisions per row (µs per decision)\n"
    )
    print(
        "| decision | n | p50 µs | p99 µs | max µs | p99 per round µs | CPU p50 / p99 µs | goal p99 < 50 µs |"
    )
    print("|---|---|---|---|---|---|---|---|")
    context: list[str] = []
    for row, ns in pooled.items():
        s = summarize(ns)
        s["p99_per_round_us"] = per_round_p99[row]
        cpu_us = np.asarray(pooled_cpu[row], dtype=np.float64) / 1000.0
        s["cpu_p50_us"] = float(np.percentile(cpu_us, 50))
        s["cpu_p99_us"] = float(np.percentile(cpu_us, 99))
        informational = row == "view_rebuild" or row in CONTEXT_ROWS
        s["goal_met"] = None if informational else s["p99_us"] < GOAL_P99_US
        goal = "(context)" if informational else ("yes" if s["goal_met"] else "**no**")
        rounds = " / ".join(f"{x:.1f}" for x in per_round_p99[row])
        line = f"| {row} | {s['n']} | {s['p50_us']:.1f} | {s['p99_us']:.1f} | {s['max_us']:.0f} | {rounds} | {s['cpu_p50_us']:.1f} / {s['cpu_p99_us']:.1f} | {goal} |"
        if row in CONTEXT_ROWS:
            report["context_rows"][row] = s
            context.append(line)
        else:
            report["rows"][row] = s
            print(line)
    if context:
        print("\nContext (no goal):\n")
        print("| row | n | p50 µs | p99 µs | max µs | p99 per round µs | CPU p50 / p99 µs | |")
        print("|---|---|---|---|---|---|---|---|")
        print("\n".join(context))
    print(
        f"\nholder budgets used: {min(ckpt):.0%}..{max(ckpt):.0%}; "
        f"holder balance (max/min ckpt tokens): {report['fleet']['holder_balance']:.2f}"
    )
    for row, s in report["rows"].items():
        if s["goal_met"] is False:
            prof = profile_row(makers[row], args.profile_decisions)
            report["profiles"][row] = prof
            print(f"\ncProfile of {row} ({args.profile_decisions} decisions), by own time:\n{prof}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
