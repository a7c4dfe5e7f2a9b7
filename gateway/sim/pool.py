"""Several simulated runs of one workload, one after another or in worker processes at once.

Every run is deterministic and independent of the others (its scenario, policy, workload and seed
decide it), so running them in processes gives exactly the results of running them in turn; only
the wall time changes. Processes are spawned (not forked: the caller may hold threads), each takes
runs from the queue and sends back its `RunResult`; progress comes back through a queue, throttled.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from gateway.core.modes import RecoveryPolicy
from gateway.sim.result import RunResult
from gateway.sim.scenario import Scenario
from gateway.sim.simulation import Simulation
from gateway.sim.workload import Workload

# progress(run_index, runs, label, simulated_time), as `run_scenario` takes it
Progress = Callable[[int, int, str, float], None]
PROGRESS_EVERY_S = 0.2  # a child reports its simulated time at most this often
# `jobs = 0` (auto) uses processes only for runs this large: a spawned process costs ~1 s to start
AUTO_MIN_REQUESTS = 20_000


@dataclass(frozen=True, slots=True)
class Job:
    label: str  # what the progress line calls it
    scenario: Scenario
    policy: RecoveryPolicy
    failures: bool  # False: the no-failure twin


def default_jobs() -> int:
    """The CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def run_all(
    plan: Sequence[Job], workload: Workload, seed: int, progress: Progress | None = None, jobs: int = 1
) -> list[RunResult]:
    """Each job's result, in the plan's order; `jobs` runs at once (1: in this process, in turn; 0:
    one per CPU for runs of `AUTO_MIN_REQUESTS` requests or more, else in turn)."""
    if jobs == 0:
        jobs = default_jobs() if len(workload) >= AUTO_MIN_REQUESTS else 1
    if jobs > 1 and len(plan) > 1:
        try:
            return _parallel(plan, workload, seed, progress, min(jobs, len(plan)))
        except _NoProcesses as exc:  # e.g. no POSIX semaphores in a restricted container
            print(f"lumen: cannot start worker processes ({exc.__cause__!r}); running in turn", file=sys.stderr)
    return [_serial(i, job, workload, seed, len(plan), progress) for i, job in enumerate(plan)]


class _NoProcesses(Exception):
    """The pool could not be set up (before any run began)."""


def _serial(i: int, job: Job, workload: Workload, seed: int, runs: int, progress: Progress | None) -> RunResult:
    sim = Simulation(job.scenario, job.policy, workload, seed, failures=job.failures)
    return sim.run(None if progress is None else (lambda t: progress(i, runs, job.label, t)))


# -- processes ---------------------------------------------------------------------------------------
_child_queue: Any = None


def _child_init(q: Any) -> None:
    global _child_queue
    _child_queue = q


def _child_run(i: int, job: Job, workload: Workload, seed: int) -> RunResult:
    last = [0.0]

    def report(t: float) -> None:
        now = time.monotonic()
        if now - last[0] >= PROGRESS_EVERY_S:
            last[0] = now
            _child_queue.put((i, t))

    sim = Simulation(job.scenario, job.policy, workload, seed, failures=job.failures)
    return sim.run(report if _child_queue is not None else None)


def _parallel(plan: Sequence[Job], workload: Workload, seed: int, progress: Progress | None, jobs: int) -> list[RunResult]:
    ctx = mp.get_context("spawn")
    try:
        q = ctx.Queue() if progress is not None else None
        pool = ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_child_init, initargs=(q,))
    except OSError as exc:
        raise _NoProcesses from exc
    horizon = max(1e-9, max(job.scenario.workload.duration_s for job in plan))
    at = [0.0] * len(plan)  # each run's fraction done
    results: list[RunResult | None] = [None] * len(plan)
    with pool:
        pending: dict[Future[RunResult], int] = {
            pool.submit(_child_run, i, job, workload, seed): i for i, job in enumerate(plan)
        }
        try:
            _collect(pending, results, at, plan, q, horizon, progress)
        except BaseException:  # a run failed (or ^C): drop the runs not started, then raise
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    return [r for r in results if r is not None]


def _collect(
    pending: dict[Future[RunResult], int],
    results: list[RunResult | None],
    at: list[float],
    plan: Sequence[Job],
    q: Any,
    horizon: float,
    progress: Progress | None,
) -> None:
    """Wait for every run, showing progress from the children's reports."""
    while pending:
        done, _ = wait(pending, timeout=PROGRESS_EVERY_S, return_when=FIRST_COMPLETED)
        for f in done:
            i = pending.pop(f)
            results[i] = f.result()
            at[i] = 1.0
        if progress is not None and q is not None and pending:
            _drain(q, at, horizon)
            # shown as the runs finished plus the least advanced of those running (an underestimate)
            finished = len(plan) - len(pending)
            behind = min(pending.values(), key=lambda i: at[i])
            others = sum(1 for i in pending.values() if at[i] > 0.0) - 1
            label = plan[behind].label + (f" (+{others} running)" if others > 0 else "")
            progress(finished, len(plan), label, at[behind] * horizon)


def _drain(q: Any, at: list[float], horizon: float) -> None:
    while True:
        try:
            i, t = q.get_nowait()
        except queue_mod.Empty:
            return
        if at[i] < 1.0:
            at[i] = min(0.999, t / horizon)
