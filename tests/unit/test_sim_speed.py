"""The simulator's speed-ups (issue 17, item 5) change nothing it computes.

`scripts/bench_sim.py golden` compares whole runs against recorded fingerprints; these tests keep the
two places where the fast path replaced a simpler one honest on their own: arrivals kept outside the
event heap run in exactly the heap's (time, sequence) order, and a decode run's `steps_within` finds
the step a bisection over `time` finds.
"""

from __future__ import annotations

import gc
import heapq
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.core.costmodel import MODELS, CostModel
from gateway.core.modes import policy_for
from gateway.sim import events as ev
from gateway.sim.request import SimRequest
from gateway.sim.result import RunResult
from gateway.sim.runner import build_workload
from gateway.sim.scenario import Scenario, parse_scenario
from gateway.sim.simulation import Simulation
from gateway.sim.stepcost import Run, StepCost
from gateway.sim.worker import SimWorker
from gateway.sim.workload import Workload


class HeapArrivals(Simulation):
    """The event loop as it was: every arrival an ARRIVAL event on the heap, pushed when the previous
    one is handled."""

    def run(self, progress: Callable[[float], None] | None = None) -> RunResult:
        q, arrivals = self.queue, self._arrivals
        if arrivals:
            q.push(arrivals[0], ev.ARRIVAL, 0)
        for i, f in enumerate(self.failures):
            q.push(f.at_s, ev.KILL, i)
        q.push(0.0, ev.TICK)
        events = 0
        while q.heap:
            t, _, kind, a, b = heapq.heappop(q.heap)
            self.now = t
            events += 1
            if kind == ev.ARRIVAL:
                r = SimRequest(a, t, self._prompts[a], self._outputs[a])
                self.requests.append(r)
                self.open += 1
                if a + 1 < len(arrivals):
                    q.push(arrivals[a + 1], ev.ARRIVAL, a + 1)
                if not self.coord.route(r, t):
                    self.wait_for_worker(r, t)
            elif kind == ev.STEP:
                a.on_step(t, b)
            else:
                self._handle(kind, a, b, t)
        return self._result(events)


def _scenario() -> Scenario:
    return parse_scenario(
        {
            "cluster": {"workers": 4, "model": "Qwen3-8B", "draft_model": "Qwen3-0.6B"},
            "workload": {"rate": 60.0, "duration_s": 20.0},
            "failures": [{"at_s": 6.0, "workers": ["w1"]}, {"at_s": 12.0, "workers": ["w2", "w3"]}],
            "sample_s": 0.25,
        },
        name="heap-order",
    )


def _tied(w: Workload) -> Workload:
    """The workload on a 50 ms grid, so that the order of simultaneous events decides what is sampled
    and routed: several arrivals at each instant, some at the failures' instants and at the sampling
    ticks. Ties go both ways: an arrival's sequence number is taken when the previous one is handled,
    so one after a lull (none in (9, 10) s) precedes the tick at 10 s, as the first (at 0) precedes the
    tick at 0, while an arrival at a tick in steady traffic follows it."""
    arrivals = np.round(w.arrivals * 20.0) / 20.0
    keep = (arrivals <= 9.0) | (arrivals >= 10.0)
    arrivals, prompts, outputs = arrivals[keep], w.prompts[keep], w.outputs[keep]
    arrivals[0] = 0.0
    return Workload(arrivals, prompts, outputs)


def _same(a: RunResult, b: RunResult) -> None:
    assert a.records == b.records
    assert a.stats == b.stats  # the event count included
    assert a.simulated_s == b.simulated_s
    assert np.array_equal(a.sample_times, b.sample_times)
    assert np.array_equal(a.queue, b.queue) and np.array_equal(a.ckpt_tokens, b.ckpt_tokens)


@pytest.mark.parametrize("mode", ["stop_restart", "lumen"])
def test_arrivals_outside_the_heap_run_in_the_heaps_order(mode: str) -> None:
    s = _scenario()
    workload = _tied(build_workload(s, 5))
    arrivals = workload.arrivals
    assert len(np.unique(arrivals)) < len(arrivals) and 10.0 in arrivals and 6.0 in arrivals  # ties
    fast = Simulation(s, policy_for(mode), workload, 5).run()
    slow = HeapArrivals(s, policy_for(mode), workload, 5).run()
    _same(fast, slow)
    assert fast.stats.restores + fast.stats.replays > 0  # the failures interrupted requests


def test_a_run_leaves_the_garbage_collector_as_it_found_it() -> None:
    s = parse_scenario({"cluster": {"workers": 2}, "workload": {"rate": 5.0, "duration_s": 2.0}})
    enabled = gc.isenabled()
    try:
        for before in (True, False):
            (gc.enable if before else gc.disable)()
            Simulation(s, policy_for("lumen"), build_workload(s, 1), 1).run()
            assert gc.isenabled() is before
    finally:
        (gc.enable if enabled else gc.disable)()


def _bisect(run: Run, dt: float, limit: int) -> int:
    """`Run.steps_within` as it was: a bisection over `time`."""
    if dt <= 0:
        return 0
    lo, hi = 0, limit
    if run.time(hi) <= dt:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if run.time(mid) <= dt:
            lo = mid
        else:
            hi = mid
    return lo


@given(
    st.sampled_from(sorted(MODELS)),
    st.integers(1, 256),
    st.integers(1, 8000),
    st.sampled_from([1.0, 1.7, 2.4]),
    st.integers(0, 4),
    st.integers(1, 3000),
    st.floats(0.0, 1.2),
)
def test_steps_within_finds_the_step_a_bisection_finds(
    model: str, b: int, ctx: int, e: float, k: int, limit: int, frac: float
) -> None:
    run = StepCost(CostModel.preset(model, "H100-80G")).decode_run(b, b * ctx, b * e, k * b)
    whole = run.time(limit)
    for dt in (frac * whole, run.time(int(frac * limit)), whole, -1.0, 0.0):
        assert run.steps_within(dt, limit) == _bisect(run, dt, limit)
        assert run.steps_within(dt, limit, whole) == _bisect(run, dt, limit)  # time(limit) given


def _enqueue_unmemoised(self: SimWorker, r: SimRequest, now: float, rank: tuple[int, float] = (1, 0)) -> None:
    """`SimWorker.enqueue` as it was: every queued request's rank asked again at each insertion."""
    self.mark_dirty()
    if not self.alive:
        self.lost.append(r)
        return
    if rank == (1, 0) and (not self.waiting or self.rank_of(self.waiting[-1]) <= rank):
        self.waiting.append(r)
    else:
        i = 0
        for q in self.waiting:
            if self.rank_of(q) > rank:
                break
            i += 1
        self.waiting.insert(i, r)
    self.kick(now)


def test_memoised_queue_ranks_give_the_same_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Queues ranked shortest-first during the recovery (most of this run's requests are inserted by
    rank), some requests resumed twice: the rank memo changes nothing."""
    s = parse_scenario(
        {
            "cluster": {"workers": 4, "model": "Qwen3-8B", "draft_model": "Qwen3-0.6B"},
            "workload": {"rate": 90.0, "duration_s": 20.0},
            "failures": [{"at_s": 5.0, "workers": ["w1"]}, {"at_s": 9.0, "workers": ["w2", "w3"]}],
        },
        name="ranked-queues",
    )
    workload = build_workload(s, 2)
    fast = Simulation(s, policy_for("lumen"), workload, 2).run()
    monkeypatch.setattr(SimWorker, "enqueue", _enqueue_unmemoised)
    slow = Simulation(s, policy_for("lumen"), workload, 2).run()
    _same(fast, slow)
    assert fast.stats.restores + fast.stats.replays > 0


@given(st.lists(st.one_of(st.floats(0.0, 3.0).map(lambda t: round(t, 1)), st.none()), max_size=120))
def test_the_written_out_heap_pops_what_heapq_pops(script: list[float | None]) -> None:
    """`events.push_event` / `pop_event` (the compiled runs' heap) against heapq, on many equal times
    (None: a pop): the same events in the same order, and a valid heap for heapq after each step."""
    mine: list[ev.Event] = []
    ref: list[ev.Event] = []
    for seq, t in enumerate(script):
        if t is None:
            if ref:
                assert ev.pop_event(mine) == heapq.heappop(ref)
        else:
            ev.push_event(mine, (t, seq, ev.STEP, None, seq))
            heapq.heappush(ref, (t, seq, ev.STEP, None, seq))
        assert all(mine[(i - 1) // 2][:2] <= mine[i][:2] for i in range(1, len(mine)))  # heap order
    while ref:
        assert ev.pop_event(mine) == heapq.heappop(ref)
    assert not mine


@pytest.mark.parametrize("mode", ["stop_restart", "lumen"])
def test_the_compiled_paths_give_the_same_run(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a compiled build runs instead of heapq and bisect (events.COMPILED, load.COMPILED),
    forced on in this interpreted process: the same run."""
    from gateway.core import load
    from gateway.sim import simulation

    s = _scenario()
    workload = _tied(build_workload(s, 5))
    plain = Simulation(s, policy_for(mode), workload, 5).run()
    for module in (ev, load):
        monkeypatch.setattr(module, "COMPILED", True)
    monkeypatch.setattr(simulation.ev, "COMPILED", True)
    compiled = Simulation(s, policy_for(mode), workload, 5).run()
    _same(plain, compiled)
    assert plain.stats.restores + plain.stats.replays > 0
