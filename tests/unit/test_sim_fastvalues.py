"""The simulator's fast paths give the same values and the same runs as the plain ones.

`gateway.sim.fastvalues` builds RequestRecord without its frozen `__init__` (the value must be
indistinguishable) and gives the simulated gateway WorkerViews it changes in place (`SeenWorker`); a
run whose every decision reads a view built from scratch of plain WorkerViews, with the plain
RequestRecord constructor, must produce exactly the same records, samples and statistics. (The simulator's other speed-ups are checked
against the tree before them by `scripts/bench_sim.py golden`, which fingerprints whole runs.)
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gateway.core.evaluation import RequestRecord
from gateway.core.health import WorkerState
from gateway.core.load import estimated_load
from gateway.core.modes import policy_for
from gateway.core.types import ClusterView, LoadParams, WorkerView
from gateway.sim import fastvalues, request
from gateway.sim import seen as seen_module
from gateway.sim.result import RunResult
from gateway.sim.runner import build_workload
from gateway.sim.scenario import parse_scenario
from gateway.sim.simulation import Simulation


def test_an_entry_changed_in_place_reads_as_a_new_worker_view() -> None:
    """seen.py changes its own entries (SeenWorkers, interpreted) and resets the L̂ memo: every reader
    then sees what a new WorkerView with those fields would show; a plain WorkerView still refuses."""
    entry = fastvalues.SeenWorker(
        "w3", WorkerState.DRAFT_READY, 2, 5, 3, 1200, 4000, 700, 7000, 10**9, "d1", 2
    )
    plain = WorkerView("w3", WorkerState.DRAFT_READY, 2, 5, 3, 1200, 4000, 700, 7000, 10**9, "d1", 2)
    assert isinstance(entry, WorkerView) and repr(entry) == repr(plain).replace("WorkerView", "SeenWorker", 1)
    params = LoadParams()
    assert estimated_load(entry, params) == estimated_load(plain, params)  # memo set
    entry.running = 1  # type: ignore[misc]
    entry.load_memo = None  # type: ignore[misc]  # what SeenCluster.view does after a change
    assert entry.running == 1
    assert [getattr(entry, f.name) for f in dataclasses.fields(WorkerView)] == [
        getattr(dataclasses.replace(plain, running=1), f.name) for f in dataclasses.fields(WorkerView)
    ]
    assert estimated_load(entry, params) == estimated_load(dataclasses.replace(plain, running=1), params)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plain.running = 1  # type: ignore[misc]


def test_request_record_equals_the_constructors_and_validates_the_same() -> None:
    args = (1.0, 1.5, 3.0, 7, True, False, 0.25)
    fast, plain = fastvalues.request_record(*args), RequestRecord(*args)
    assert type(fast) is RequestRecord and fast == plain and repr(fast) == repr(plain)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.error = True  # type: ignore[misc]
    for bad in ((1.0, 1.5, None, 7, False, False, None), (2.0, 1.5, 3.0, 7, False, False, None)):
        with pytest.raises(ValueError):
            RequestRecord(*bad)
        with pytest.raises(ValueError):
            fastvalues.request_record(*bad)


def _run(mode: str) -> RunResult:
    s = parse_scenario(
        {
            "cluster": {"workers": 5, "model": "Qwen3-8B", "draft_model": "Qwen3-0.6B"},
            "workload": {"rate": 50.0, "duration_s": 24.0},
            "failures": [{"at_s": 8.0, "workers": ["w1"]}, {"at_s": 14.0, "workers": ["w2", "w4"]}],
        },
        name="fast-paths",
    )
    return Simulation(s, policy_for(mode), build_workload(s, 3), 3).run()


def test_a_run_with_the_plain_values_is_identical(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same run when every decision reads a view made from scratch of plain WorkerViews (so its
    ranked tables are built afresh) and every record comes from RequestRecord's own constructor."""
    fast = _run("lumen")
    in_place = seen_module.SeenCluster.view

    def scratch_view(self: seen_module.SeenCluster) -> ClusterView:
        init = [f.name for f in dataclasses.fields(WorkerView) if f.init]
        seen = in_place(self).workers
        return ClusterView({wid: WorkerView(*(getattr(w, n) for n in init)) for wid, w in seen.items()})

    monkeypatch.setattr(seen_module.SeenCluster, "view", scratch_view)
    monkeypatch.setattr(request, "request_record", RequestRecord)
    plain = _run("lumen")
    assert fast.records == plain.records
    assert fast.stats == plain.stats
    assert np.array_equal(fast.sample_times, plain.sample_times)
    assert np.array_equal(fast.queue, plain.queue) and np.array_equal(fast.ckpt_tokens, plain.ckpt_tokens)
    assert fast.stats.restores + fast.stats.replays > 0  # the failures did interrupt requests
