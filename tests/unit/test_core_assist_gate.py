"""Draft assist's cost gate (gateway.core.speculation.assist_gain / assist_pays) and the gated pairing."""

import heapq
import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.costmodel import CostModel, StepWork
from gateway.core.health import WorkerState
from gateway.core.pairing import PairingParams, draft_first_pays, pair_drafters
from gateway.core.speculation import (
    AssistGate,
    assist_gain,
    assist_pays,
    expected_tokens_per_step,
    load_pays,
    overloaded,
    request_time,
    view_gain,
)
from gateway.core.types import ClusterView, LoadParams, ParamError, WorkerView
from gateway.sim.events import RESTORED, STEP, EventQueue
from gateway.sim.request import SimRequest
from gateway.sim.stepcost import StepCost
from gateway.sim.worker import SimWorker
from gateway.sim.workload import CODE_INPUT, CODE_OUTPUT, CONV_INPUT, CONV_OUTPUT, LengthFit

TARGET = CostModel.preset("Qwen3-32B", "H100-80G")
DRAFTER = CostModel.preset("Qwen3-1.7B", "H100-80G")
GATE = AssistGate(TARGET, DRAFTER, 0.7, 1, 8, nominal_batch=64)  # conversation requests (1,155 / 211)
# short prompts, long outputs (200 / 800): decoding is most of the target's time, and drafting pays
DECODING = AssistGate(TARGET, DRAFTER, 0.7, 1, 8, nominal_batch=64, prompt_tokens=200, output_tokens=800)


@given(st.integers(1, 256), st.floats(1.0, 8000.0), st.integers(0, 16))
def test_the_batch_step_time_is_the_per_request_roofline(batch: int, ctx: float, verify: int) -> None:
    c = int(ctx)
    want = TARGET.step_time(StepWork(decode_contexts=[c] * batch, verify_tokens=verify))
    assert TARGET.batch_step_time(batch, c, verify) == pytest.approx(want, rel=1e-12)


@given(
    st.integers(1, 512), st.floats(1.0, 8000.0), st.floats(0.0, 1.0), st.sampled_from([0.0, 300.0, 1155.0])
)
def test_free_drafts_gain_at_least_as_much_as_drafts_that_cost(
    batch: int, ctx: float, a: float, prompt: float
) -> None:
    free = assist_gain(AssistGate(TARGET, None, a, prompt_tokens=prompt), batch, ctx)[1]
    paid = assist_gain(AssistGate(TARGET, DRAFTER, a, prompt_tokens=prompt), batch, ctx)[1]
    assert paid <= free + 1e-12


@given(st.integers(1, 512), st.floats(1.0, 8000.0), st.floats(0.0, 1.0))
def test_without_prompts_the_gain_is_decode_throughput(batch: int, ctx: float, a: float) -> None:
    # prompt_tokens 0: the chosen k's tokens per step over its relative step time (the first gate's model)
    k, gain = assist_gain(AssistGate(TARGET, DRAFTER, a, prompt_tokens=0.0), batch, ctx)
    plain = TARGET.batch_step_time(batch, ctx)
    drafted = TARGET.batch_step_time(batch, ctx, batch * k) + k * DRAFTER.batch_step_time(batch, ctx)
    assert gain == pytest.approx(expected_tokens_per_step(a, k) * plain / drafted)


@settings(max_examples=50)
@given(st.floats(0.3, 0.95))
def test_the_gain_falls_as_the_batch_grows(a: float) -> None:
    gate = AssistGate(TARGET, DRAFTER, a)
    gains = [assist_gain(gate, b, 1500.0)[1] for b in (1, 16, 64, 256)]
    assert all(x >= y - 1e-9 for x, y in itertools.pairwise(gains))
    assert assist_gain(gate, 1024, 1500.0)[1] < 1.0  # compute bound: verifying drafts costs more


def test_request_time_worked_example() -> None:
    # P = 1024, O = 256, 64 requests of context 1000, k = 1 at a = 0.5: E = 1.5 tokens per step, so a
    # request takes 256 / (64 · 1.5) = 2.667 steps, one of them carrying the newcomer's whole prompt
    gate = AssistGate(TARGET, DRAFTER, 0.5, prompt_tokens=1024, output_tokens=256)
    wait = DRAFTER.batch_step_time(64, 1000)
    mixed = TARGET.step_time(StepWork(prefill=((1024, 0),), decode_contexts=[1000] * 64, verify_tokens=64))
    decode = TARGET.batch_step_time(64, 1000, 64)
    want = (mixed + wait) + (256 / 96 - 1) * (decode + wait)
    assert request_time(gate, 64, 1000, 1) == pytest.approx(want, rel=1e-12)
    # plain: 4 steps per request, one of them mixed
    plain = TARGET.step_time(
        StepWork(prefill=((1024, 0),), decode_contexts=[1000] * 64)
    ) + 3 * TARGET.batch_step_time(64, 1000)
    assert request_time(gate, 64, 1000, 0) == pytest.approx(plain, rel=1e-12)
    # short outputs: more than one request ends per step, their prompts share a step (every step mixed)
    short = AssistGate(TARGET, DRAFTER, 0.5, prompt_tokens=1024, output_tokens=16)
    both = TARGET.step_time(
        StepWork(prefill=((1024, 0), (1024, 0), (1024, 0), (1024, 0)), decode_contexts=[1000] * 64)
    )
    assert request_time(short, 64, 1000, 0) == pytest.approx(both / 4, rel=1e-12)


def test_paper_4w_conv_numbers() -> None:
    # Qwen3-32B TP2 + Qwen3-1.7B, a = 0.7, a full batch of conversation requests (1,155 / 211 tokens,
    # mean context 1,155 + 211 / 2): drafting completes requests only 9 % faster (k = 1), though it
    # decodes 25 % faster (k = 2), since half of the target's time goes to prefill
    k, gain = assist_gain(GATE, 64, 1260.5)
    assert k == 1 and gain == pytest.approx(1.094, abs=0.002)
    decode_only = assist_gain(AssistGate(TARGET, DRAFTER, prompt_tokens=0.0), 64, 1260.5)
    assert decode_only[0] == 2 and decode_only[1] == pytest.approx(1.249, abs=0.002)
    # the simulator loads the draft model (1.7 s of weights) before the full weights (16.4 s): a
    # drafter then needs 1 + 1.7 / 16.4 = 1.104 to make up for the full model serving later
    serial = AssistGate(
        TARGET, DRAFTER, load_delay_s=DRAFTER.weights_time(), assist_window_s=TARGET.weights_time()
    )
    assert serial.load_delay_s == pytest.approx(1.7) and serial.assist_window_s == pytest.approx(16.4)
    assert not load_pays(serial, gain)
    assert load_pays(serial, 1.11) and load_pays(GATE, gain)  # loaded side by side: no delay to make up


@pytest.mark.parametrize(
    ("target", "drafter", "tp", "pays"),
    [
        ("Qwen3-32B", "Qwen3-1.7B", 2, False),
        ("Qwen3-14B", "Qwen3-0.6B", 1, True),
        ("Llama-3-70B", "Llama-3.2-1B", 4, True),
    ],
)
def test_draft_first_pays_where_the_window_gain_beats_the_load_delay(
    target: str, drafter: str, tp: int, pays: bool
) -> None:
    # paper-4w, paper-8w and scale-N deployments, overloaded with conversation requests; min_gain 1:
    # only the load's economics (the break-evens are 1.104, 1.041 and 1.070; the gains 1.094, 1.100, 1.145)
    t, d = CostModel.preset(target, "H100-80G", tp), CostModel.preset(drafter, "H100-80G")
    gate = AssistGate(
        t, d, min_gain=1.0, nominal_batch=64, load_delay_s=d.weights_time(), assist_window_s=t.weights_time()
    )
    params = PairingParams(load=LoadParams(nominal_batch=64), gate=gate)
    busy = WorkerView("w1", WorkerState.HEALTHY, 1, 64, 20, 64 * 1366, t.kv_capacity_tokens())
    restarting = WorkerView("w0", WorkerState.RESTARTING, 2)
    view = ClusterView.of([restarting, busy])
    assert draft_first_pays(view, params) is pays
    assert draft_first_pays(view, PairingParams(load=LoadParams(nominal_batch=64), gate=None))  # the paper's
    calm = ClusterView.of([restarting, WorkerView("w1", WorkerState.HEALTHY, 1, 64, 0, 64 * 1366, 300_000)])
    assert not draft_first_pays(calm, params)  # nothing waits: no target at all


def test_a_snapshot_refilling_its_batch_is_judged_at_the_full_batch() -> None:
    # 58 running and 20 queued is a full batch of 64 a step later, not a batch of 58 that gains more;
    # it is judged at the load's mean context (1,155 + 211 / 2), whatever this snapshot's KV says
    w = WorkerView("w1", WorkerState.HEALTHY, 1, 58, 20, 58 * 1366, 300_000)
    assert view_gain(GATE, w) == assist_gain(GATE, 64, 1260.5)
    assert view_gain(GATE, WorkerView("w2", WorkerState.HEALTHY, 1, 64, 3, 64 * 1900, 300_000)) == view_gain(
        GATE, w
    )
    # ... unless its KV holds fewer at its mean size per request
    tight = WorkerView("w1", WorkerState.HEALTHY, 1, 58, 20, 58 * 1366, 60 * 1366)
    assert view_gain(GATE, tight) == assist_gain(GATE, 60, 1260.5)
    # without prefill in the model, the context is the view's KV in use per request
    decode = AssistGate(TARGET, DRAFTER, nominal_batch=64, prompt_tokens=0.0)
    assert view_gain(decode, w) == assist_gain(decode, 64, 1366.0)


class _Host:
    def __init__(self) -> None:
        self.queue = EventQueue()
        self.done: list[float] = []

    def on_prefilled(self, r: SimRequest, now: float) -> None:
        r.emitted += 1

    def on_finished(self, r: SimRequest, now: float) -> None:
        self.done.append(now)

    def on_rejected(self, r: SimRequest, now: float) -> None:
        raise AssertionError("rejected")


def saturated_rate(prompts: np.ndarray, outputs: np.ndarray, k: int, ctx: float) -> float:
    """Requests per second a simulated Qwen3-32B worker completes with a standing queue, drafting k."""
    host = _Host()
    w = SimWorker(
        host, "w", "d", StepCost(TARGET), TARGET.restore_time(1), 64, 8192, TARGET.kv_capacity_tokens(), 0
    )
    for i, (p, o) in enumerate(zip(prompts.tolist(), outputs.tolist(), strict=True)):
        w.enqueue(SimRequest(i, 0.0, p, o), 0.0)
    if k:
        wait = k * DRAFTER.batch_step_time(64, ctx)
        w.set_speculation(k, expected_tokens_per_step(0.7, k), 0.0, wait)
    n = len(prompts)
    heap = host.queue.heap
    while heap and len(host.done) < 0.8 * n:
        t, _, kind, a, b = heapq.heappop(heap)
        if kind == STEP:
            a.on_step(t, b)
        elif kind == RESTORED:
            a.on_restored(b[0], t)
    lo, hi = int(0.2 * n), int(0.8 * n) - 1  # the steady middle
    return (hi - lo) / (host.done[hi] - host.done[lo])


@pytest.mark.parametrize(("inputs", "outputs"), [(CONV_INPUT, CONV_OUTPUT), (CODE_INPUT, CODE_OUTPUT)])
def test_the_gain_is_what_a_simulated_saturated_worker_measures(
    inputs: LengthFit, outputs: LengthFit
) -> None:
    # conversation: drafting pays ~9 %; code-like (~2k in, ~30 out): mostly prefill, drafting costs
    rng = np.random.default_rng(1)
    prompts, outs = inputs.sample(rng, 1500), outputs.sample(rng, 1500)
    p, o = float(prompts.mean()), float(outs.mean())
    ctx = p + o / 2  # the batch's mean context
    gate = AssistGate(TARGET, DRAFTER, prompt_tokens=p, output_tokens=o)
    base = saturated_rate(prompts, outs, 0, ctx)
    for k in (1, 2):
        measured = saturated_rate(prompts, outs, k, ctx) / base
        model = request_time(gate, 64, ctx, 0) / request_time(gate, 64, ctx, k)
        assert model == pytest.approx(measured, abs=0.015), k


def view(running: int, waiting: int, kv: int = 0) -> WorkerView:
    return WorkerView("w1", WorkerState.HEALTHY, 1, running, waiting, kv, 300_000)


def test_an_idle_or_not_overloaded_survivor_is_not_drafted_for() -> None:
    assert not assist_pays(DECODING, view(0, 0))
    assert not assist_pays(DECODING, view(10, 0, 15_000))  # room in the batch, nothing waiting
    assert not assist_pays(DECODING, view(10, 3, 15_000))  # a momentary queue in front of a batch with room
    assert assist_pays(DECODING, view(64, 5, 100_000))  # a full batch and a queue: drafting pays
    assert overloaded(DECODING, view(64, 1)) and not overloaded(DECODING, view(63, 1))
    # conversation requests: the same full batch completes requests only ~9 % faster, below min_gain
    assert not assist_pays(GATE, view(64, 5, 100_000))


def test_a_large_batch_is_not_drafted_for_even_when_overloaded() -> None:
    big = AssistGate(TARGET, DRAFTER, 0.7, 1, 8, nominal_batch=1024)
    assert not assist_pays(big, view(1024, 50, 1024 * 2000))


def test_gate_bounds_name_the_field() -> None:
    bad: tuple[tuple[dict[str, Any], str], ...] = (
        ({"min_gain": -1.0}, "min_gain"),
        ({"min_waiting": -1}, "min_waiting"),
        ({"prompt_tokens": -1.0}, "prompt_tokens"),
        ({"output_tokens": 0.0}, "output_tokens"),
        ({"chunk": 0}, "chunk"),
        ({"load_delay_s": float("inf")}, "load_delay_s"),
        ({"assist_window_s": -1.0}, "assist_window_s"),
    )
    for kw, field in bad:
        with pytest.raises(ParamError) as exc:
            AssistGate(TARGET, **kw)
        assert exc.value.field == field


def test_gated_pairing_skips_an_idle_target_and_keeps_a_pair_while_it_still_pays() -> None:
    params = PairingParams(load=LoadParams(nominal_batch=64), gate=DECODING)
    d = WorkerView("w0", WorkerState.DRAFT_READY, 2)
    busy = WorkerView("w1", WorkerState.HEALTHY, 1, 64, 20, 100_000, 300_000)
    calm = WorkerView("w1", WorkerState.HEALTHY, 1, 64, 0, 100_000, 300_000)
    idle = WorkerView("w1", WorkerState.HEALTHY, 1, 2, 0, 3_000, 300_000)
    assert pair_drafters(ClusterView.of([d, busy]), ["w0"], {}, params) == {"w0": "w1"}
    assert pair_drafters(ClusterView.of([d, calm]), ["w0"], {}, params) == {}  # new pairs need a queue
    assert pair_drafters(ClusterView.of([d, calm]), ["w0"], {"w0": "w1"}, params) == {"w0": "w1"}
    ungated = PairingParams(load=LoadParams(nominal_batch=64))
    assert pair_drafters(ClusterView.of([d, idle]), ["w0"], {}, ungated) == {"w0": "w1"}
    assert pair_drafters(ClusterView.of([d, idle]), ["w0"], {}, params) == {}
