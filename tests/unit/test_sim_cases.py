"""Simulator runs small enough to work out by hand from the cost model."""

from typing import Any

import numpy as np
import pytest

from gateway.core.costmodel import CostModel
from gateway.core.modes import policy_for
from gateway.sim import trace as tr
from gateway.sim.result import RunResult
from gateway.sim.scenario import ScenarioError, parse_scenario
from gateway.sim.simulation import Simulation
from gateway.sim.workload import Workload

COST = CostModel.preset("Qwen3-32B", "H100-80G")
KVB = COST.model.kv_bytes_per_token
DETECT = 0.06
NET = 25e9


def run(mode: str, requests: list[tuple[float, int, int]], **scenario: Any) -> RunResult:
    data: dict[str, Any] = {"cluster": {"workers": 1}, "workload": {"rate": 1.0}}
    for key, value in scenario.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    s = parse_scenario(data)
    arr = np.array(requests, dtype=np.float64).reshape(-1, 3)
    w = Workload(arr[:, 0], arr[:, 1].astype(np.int64), arr[:, 2].astype(np.int64))
    return Simulation(s, policy_for(mode), w, seed=1).run()


def decode_ends(start: float, ctx0: int, steps: int) -> list[float]:
    """End times of `steps` single-request decode steps starting at `start`, first context ctx0."""
    out, t = [], start
    for j in range(steps):
        t += COST.decode_step_time([ctx0 + j])
        out.append(t)
    return out


def test_one_request_ttft_is_one_prefill_step_and_tpot_the_decode_steps() -> None:
    (r,) = run("lumen", [(0.0, 1000, 10)]).records
    assert r.first_token == pytest.approx(COST.prefill_time(1000), rel=1e-12)
    # after the prefill token, 9 decode steps over contexts 1001..1009
    assert r.last_token == pytest.approx(decode_ends(r.first_token, 1001, 9)[-1], rel=1e-12)
    assert r.output_tokens == 10 and not r.interrupted


def test_long_prompt_is_prefilled_in_chunks() -> None:
    (r,) = run("lumen", [(0.5, 10_000, 1)]).records
    expected = 0.5 + COST.prefill_time(8192, 0) + COST.prefill_time(10_000 - 8192, 8192)
    assert r.first_token == pytest.approx(expected, rel=1e-12)
    assert r.last_token == r.first_token


def test_two_prompts_share_one_prefill_step() -> None:
    a, b = run("lumen", [(0.0, 1000, 1), (0.0, 2000, 1)]).records
    # the second arrives while the first's step runs (same instant, later event): it waits for the next step
    assert a.first_token == pytest.approx(COST.prefill_time(1000), rel=1e-12)
    assert b.first_token == pytest.approx(a.first_token + COST.prefill_time(2000), rel=1e-12)


def test_gray_failure_slows_every_step() -> None:
    (r,) = run("lumen", [(1.0, 1000, 1)], failures=[{"at_s": 0.0, "kind": "slow", "workers": ["w0"]}]).records
    assert r.first_token == pytest.approx(1.0 + 5 * COST.prefill_time(1000), rel=1e-12)


KILL_AT = 1.0
PROMPT, OUT = 1000, 200
TWO = {"cluster": {"workers": 2, "network_bw": NET}, "failures": [{"at_s": KILL_AT, "workers": ["w0"]}]}


def emitted_by(t: float) -> int:
    """Tokens of the one request (alone on w0) emitted by time t."""
    first = COST.prefill_time(PROMPT)
    return 1 + sum(1 for e in decode_ends(first, PROMPT + 1, OUT - 1) if e <= t)


def test_kill_with_one_survivor_replay_costs_a_full_prefill() -> None:
    res = run("stop_restart", [(0.0, PROMPT, OUT)], **TWO)
    (r,) = res.records
    emitted = emitted_by(KILL_AT)
    last_before = decode_ends(COST.prefill_time(PROMPT), PROMPT + 1, emitted - 1)[-1]
    resumed = KILL_AT + DETECT + COST.prefill_time(PROMPT + emitted)
    assert r.interrupted and not r.error and r.output_tokens == OUT
    assert r.resume_delay == pytest.approx(resumed - last_before, rel=1e-9)
    assert res.stats.replays == 1 and res.stats.restores == 0
    # the rest decodes on w1 from the replayed context
    assert r.last_token == pytest.approx(
        decode_ends(resumed, PROMPT + emitted + 1, OUT - emitted - 1)[-1], rel=1e-9
    )


@pytest.mark.parametrize("mode", ["lumen", "fixed_checkpoint"])
def test_kill_with_one_survivor_restore_costs_restore_plus_tail_prefill(mode: str) -> None:
    res = run(mode, [(0.0, PROMPT, OUT)], **TWO)
    (r,) = res.records
    lag = 64 * (KVB / (COST.gpu.d2h_bw * COST.tp) + KVB / NET)  # one page: device -> host -> network
    durable = (PROMPT + emitted_by(KILL_AT - lag)) // 64 * 64
    context = PROMPT + emitted_by(KILL_AT)
    last_before = decode_ends(COST.prefill_time(PROMPT), PROMPT + 1, emitted_by(KILL_AT) - 1)[-1]
    resumed = KILL_AT + DETECT + COST.restore_time(durable) + COST.prefill_time(context - durable, durable)
    assert res.stats.restores == 1 and res.stats.restored_tokens == durable
    assert r.resume_delay == pytest.approx(resumed - last_before, rel=1e-9)
    assert r.output_tokens == OUT and res.stats.coverage == 1.0


def test_mode_none_fails_the_interrupted_request() -> None:
    res = run("none", [(0.0, PROMPT, OUT), (5.0, 100, 2)], **TWO)
    lost, later = res.records
    assert lost.error and lost.interrupted and lost.output_tokens == emitted_by(KILL_AT)
    assert not later.error and later.first_token == pytest.approx(5.0 + COST.prefill_time(100), rel=1e-12)


def test_request_larger_than_the_kv_cache_fails() -> None:
    res = run("lumen", [(0.0, 5000, 10), (0.0, 10, 2)], cluster={"kv_capacity_tokens": 4096})
    big, small = res.records
    assert big.error and big.first_token is None
    assert not small.error


def test_no_survivor_waits_for_the_restart_then_gives_up() -> None:
    fail = {"failures": [{"at_s": 0.5, "workers": ["w0"]}]}
    (r,) = run("stop_restart", [(0.0, 1000, 400)], **fail).records
    # reload takes longer than the 5 s a request waits for a HEALTHY worker
    assert r.interrupted and r.error
    rec = {"no_worker_wait_s": 600.0}
    (r,) = run("stop_restart", [(0.0, 1000, 400)], recovery=rec, **fail).records
    assert r.interrupted and not r.error and r.output_tokens == 400
    # it resumed only once the restarted worker loaded its model
    assert r.last_token > 0.5 + DETECT + COST.load_time()


def test_draft_assist_speeds_the_survivor_while_the_failed_worker_reloads() -> None:
    # w1 keeps a long request; w0 dies and, with draft assist, drafts for w1 until it has reloaded
    # (the paper's unconditional pairing: w1 has nothing waiting, so the cost gate would not pair it)
    reqs = [(0.0, 1000, 20), (0.0, 100, 3000)]
    fail = {"cluster": {"workers": 2}, "failures": [{"at_s": 0.2, "workers": ["w0"]}]}
    ungated = {"assist_gate": False}
    with_draft = run("lumen", reqs, draft=ungated, **fail)
    without = run("lumen-no-draft", reqs, draft=ungated, **fail)
    assert with_draft.stats.pairings >= 1 and with_draft.stats.acceptance_rate == 0.7
    assert without.stats.pairings == 0
    assert with_draft.records[1].last_token < without.records[1].last_token


def test_the_cost_gate_does_not_draft_for_a_survivor_with_nothing_waiting() -> None:
    # the same failure: w1's one request has no queue behind it, so no draft model is loaded first
    reqs = [(0.0, 1000, 20), (0.0, 100, 3000)]
    fail = {"cluster": {"workers": 2}, "failures": [{"at_s": 0.2, "workers": ["w0"]}]}
    gated = run("lumen", reqs, **fail)
    assert gated.stats.pairings == 0
    assert not any(rl.draft_first for rl in gated.stats.reloads)


def test_draft_assist_with_drafter_latency_helps_less() -> None:
    reqs = [(0.0, 1000, 20), (0.0, 100, 3000)]
    fail: dict[str, Any] = {"cluster": {"workers": 2}, "failures": [{"at_s": 0.2, "workers": ["w0"]}]}
    free = {"assist_gate": False, "drafter_latency": False}
    fast = run("lumen", reqs, draft=free, **fail).records[1].last_token
    slow = run("lumen", reqs, draft={**free, "drafter_latency": True}, **fail).records[1].last_token
    assert fast is not None and slow is not None and fast < slow


@pytest.mark.parametrize("enabled", [False, True])
def test_gray_failure_degrades_the_slow_worker_and_moves_its_requests_when_enabled(enabled: bool) -> None:
    # 4 workers, 40 long requests spread over them; w0 becomes 20x slower at 2 s
    reqs = [(0.05 * i, 500, 400) for i in range(40)]
    res = run(
        "lumen",
        reqs,
        cluster={"workers": 4},
        gray={"enabled": enabled, "window_s": 2.0, "probation_s": 600.0},
        failures=[{"at_s": 2.0, "kind": "slow", "workers": ["w0"], "slowdown": 20.0}],
    )
    assert not any(r.error for r in res.records)
    moved = sum(1 for r in res.records if r.interrupted)
    if enabled:
        assert res.stats.degradations == 1 and moved > 0
        assert res.stats.restores + res.stats.replays == moved
    else:
        assert res.stats.degradations == 0 and moved == 0


def test_the_outage_batch_boost_lets_the_survivor_run_a_larger_batch_until_the_backlog_drains() -> None:
    # 2 workers with a batch limit of 4; 12 long requests; w0 dies: w1 gets 8 requests' worth of work
    reqs = [(0.01 * i, 200, 400) for i in range(12)]
    fail = {
        "cluster": {"workers": 2, "max_running_requests": 4},
        "failures": [{"at_s": 0.5, "workers": ["w0"]}],
        "recovery": {"no_worker_wait_s": 600.0},
    }
    off = {**fail, "recovery": {"outage_batch_boost": 1.0, "no_worker_wait_s": 600.0}}
    on = {**fail, "recovery": {"outage_batch_boost": 2.0, "no_worker_wait_s": 600.0}}
    plain, boosted = run("lumen", reqs, **off), run("lumen", reqs, **on)
    assert not any(r.error for r in plain.records + boosted.records)

    def mean_ttft(res: RunResult) -> float:
        return sum((r.first_token or 0.0) - r.arrival for r in res.records) / len(res.records)

    # a larger batch admits the queued requests earlier
    assert mean_ttft(boosted) < mean_ttft(plain)
    # a baseline as published has no such lever: the setting does not change it
    for mode in ("stop_restart", "fixed_checkpoint"):
        assert [r.first_token for r in run(mode, reqs, **off).records] == [
            r.first_token for r in run(mode, reqs, **on).records
        ]


def test_on_a_measured_prefill_bound_load_the_boost_gate_keeps_the_batch_limit() -> None:
    """core/outage.py `boost_gain`: 1,200 code-like requests (long prompts, 2-token outputs) complete,
    so the simulated gateway knows the load's shape; then w0 dies under a burst. The gate keeps the
    survivor's batch limit (a larger batch would complete such requests no faster); with the gate
    off (boost_min_gain 0) the same run boosts."""
    reqs = [(0.05 * i, 2000, 2) for i in range(1200)] + [(60.0 + 0.001 * i, 2000, 2) for i in range(300)]
    spec: dict[str, Any] = {
        "cluster": {"workers": 2, "max_running_requests": 8},
        "workload": {"rate": 1.0},
        "failures": [{"at_s": 60.0, "workers": ["w0"]}],
        "recovery": {"no_worker_wait_s": 600.0},
    }

    def boosts(min_gain: float | None) -> tuple[list[float], RunResult]:
        data = {**spec, "recovery": {**spec["recovery"]}}
        if min_gain is not None:
            data["recovery"]["outage_boost_min_gain"] = min_gain
        arr = np.array(reqs, dtype=np.float64)
        w = Workload(arr[:, 0], arr[:, 1].astype(np.int64), arr[:, 2].astype(np.int64))
        sim = Simulation(parse_scenario(data), policy_for("lumen"), w, seed=1)
        rec = tr.TraceRecorder()
        rec.attach(sim)
        res = sim.run()
        assert sim.coord.shape.ready
        return [e.boost for e in rec.events if isinstance(e, tr.Outage) and e.recovering], res

    gated, res = boosts(None)  # the default gate
    ungated, res0 = boosts(0.0)
    assert gated and all(b == 1.0 for b in gated)  # a recovery, shortest first, no larger batch
    assert max(ungated) == 1.5
    assert not any(r.error for r in res.records)
    # the run's stats keep every judgement: the factor 2 of 2 workers' slots call for (capped at
    # 1.5), the cost model's gain for the measured shape, granted or not
    (j,) = res.stats.boosts
    assert j.at_s >= 60.0 and j.factor == 1.5 and j.gain is not None and j.gain < 1.05 and not j.granted
    (j0,) = res0.stats.boosts
    assert j0.granted and j0.gain == j.gain


def test_shortest_prefill_first_orders_a_survivors_queue_only_while_recovering() -> None:
    # w1 is busy with 1 long request (batch limit 1); w0 dies with nothing; then a long and a short
    # prompt arrive: while recovering the short one goes first, otherwise FIFO
    reqs = [(0.0, 100, 2000), (0.0, 100, 3000), (1.0, 3000, 2), (1.01, 50, 2)]
    fail = {
        "cluster": {"workers": 2, "max_running_requests": 1},
        "failures": [{"at_s": 0.5, "workers": ["w0"]}],
        "recovery": {"no_worker_wait_s": 600.0},
    }
    fifo_recovery = {"outage_shortest_first": False, "no_worker_wait_s": 600.0}
    fifo = run("lumen", reqs, **{**fail, "recovery": fifo_recovery}).records
    sjf_recovery = {"outage_shortest_first": True, "no_worker_wait_s": 600.0}
    sjf = run("lumen", reqs, **{**fail, "recovery": sjf_recovery}).records
    assert fifo[2].first_token is not None and fifo[3].first_token is not None
    assert sjf[2].first_token is not None and sjf[3].first_token is not None
    assert fifo[2].first_token < fifo[3].first_token  # FIFO: the long prompt was first in the queue
    assert sjf[3].first_token < sjf[2].first_token  # shortest first while w0 reloads
    # aged: the long prompt (2,950 tokens more) arrived 0.01 s earlier, so it keeps its place only at
    # a rate above 2,950 / 0.01 tokens per second
    for rate, short_first in ((1e6, False), (1e5, True)):
        aged = {**sjf_recovery, "outage_shortest_first_rate": rate}
        got = run("lumen", reqs, **{**fail, "recovery": aged}).records
        assert (got[3].first_token < got[2].first_token) == short_first, rate  # type: ignore[operator]
    # a baseline as published keeps FIFO
    base = run("fixed_checkpoint", reqs, **{**fail, "recovery": sjf_recovery}).records
    assert base[2].first_token < base[3].first_token  # type: ignore[operator]


@pytest.mark.parametrize(
    ("key", "value"),
    [("outage_batch_boost", 0.5), ("outage_shortest_first_rate", -1.0), ("outage_boost_min_gain", -1.0)],
)
def test_a_bad_outage_lever_in_a_scenario_names_its_key(key: str, value: float) -> None:
    with pytest.raises(ScenarioError, match=rf"recovery\.{key}: must be"):
        parse_scenario({"workload": {"rate": 1.0}, "recovery": {key: value}})
