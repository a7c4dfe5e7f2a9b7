"""Speculation-assisted progressive recovery, worker side, in-process (DESIGN 1.3, 4.5).

A restarting worker with a draft model goes LOADING_DRAFT -> DRAFT_READY -> SERVING, drafting for a
target meanwhile; a target paired with it (StartDraftAssist through its agent's `handle`) verifies
the drafts in its own steps. Outputs must stay exactly the non-assisted ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from draft_models.client import DraftClient
from gateway.core.costmodel import CostModel
from gateway.core.health import Phase
from gateway.protocol import control_pb2 as pb
from gateway.protocol.generate import GenerateRequest, LumenExt, SamplingParams, decode_chunk
from gateway.protocol.launch import EngineSpec
from gateway.protocol.planes import Member, PlaneAuth
from gateway.server.workers.control import ControlService, start_control_server
from gateway.server.workers.monitor import LoadMonitor
from models.synthetic import expected_output
from tests.fixtures.planes import introduce, member
from worker_hooks.agent import Agent
from worker_hooks.engine.engine import Engine
from worker_hooks.engine.handle import RequestHandle
from worker_hooks.engine.loading import LoadPlan, load_plan, plain_plan
from worker_hooks.engine.service import Worker, start_worker
from worker_hooks.engine.speculative import MAX_MISSES

# Qwen3-8B drafted by Qwen3-0.6B (a registered pair); tiny time_scale keeps every test fast
BASE: dict[str, Any] = {
    "control_address": "",
    "model": "Qwen3-8B",
    "draft_model": "Qwen3-0.6B",
    "time_scale": 0.01,
    "page_size": 16,
    "log_level": "warning",
}


def spec(worker_id: str = "w", **kw: Any) -> EngineSpec:
    return EngineSpec(worker_id=worker_id, **(BASE | kw))


def drafter_spec(agreement: float = 0.7, **kw: Any) -> EngineSpec:
    """A restart that drafts at once and whose full model stays loading for the whole test."""
    return spec("d", restart=True, draft_load_s=0.0, model_load_s=1e5, draft_agreement=agreement, **kw)


async def wait_until(cond: Any, within: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not cond():
        if loop.time() > deadline:
            raise TimeoutError(f"condition not met within {within} s")
        await asyncio.sleep(0.002)


# -- the load plan ----------------------------------------------------------------------------------


def test_load_plan_loads_the_draft_then_the_full_weights_from_one_storage() -> None:
    engine_cost = Engine(spec()).cost
    draft_weights = CostModel.preset("Qwen3-0.6B", "H100-80G").weights_time()
    assert load_plan(spec(), engine_cost) == LoadPlan(Phase.SERVING)
    plain = load_plan(spec(restart=True, draft_model="", model_load_s=40.0), engine_cost)
    assert plain == LoadPlan(Phase.LOADING_FULL, ((0.4, Phase.SERVING),))
    assert plain_plan(spec(restart=True, model_load_s=40.0, draft_load_s=10.0), engine_cost) == plain
    # the full model serves the draft's weights time later than a plain restart: the simulator's
    # timeline (core/reload.py DraftFirst), which the draft-assist gate charges
    prog = load_plan(spec(restart=True, model_load_s=40.0, draft_load_s=10.0), engine_cost)
    assert prog.first is Phase.LOADING_DRAFT
    (t_draft, p_draft), (t_full, p_full) = prog.changes
    assert (p_draft, p_full) == (Phase.DRAFT_READY, Phase.SERVING)
    assert t_draft == pytest.approx(0.1) and t_full == pytest.approx(0.01 * (40.0 + draft_weights))
    assert prog.drafts and not plain.drafts
    # from the cost model: Qwen3-0.6B loads well before Qwen3-8B (both pay the engine start-up)
    auto = load_plan(spec(restart=True, time_scale=1.0), engine_cost)
    (t_draft, _), (t_full, _) = auto.changes
    assert 20.0 < t_draft < t_full == pytest.approx(engine_cost.load_time() + draft_weights)
    # a draft model that would not be ready first is not loaded at all
    slow = load_plan(spec(restart=True, model_load_s=10.0, draft_load_s=10.0), engine_cost)
    assert slow == LoadPlan(Phase.LOADING_FULL, ((0.1, Phase.SERVING),)) and not slow.drafts


def test_an_incompatible_draft_model_is_refused() -> None:
    with pytest.raises(ValueError, match="not smaller"):
        Engine(spec(model="Qwen3-0.6B", draft_model="Qwen3-1.7B", restart=True))


# -- the lifecycle ----------------------------------------------------------------------------------


async def ttft(http: aiohttp.ClientSession, url: str, rid: str, prompt: list[int]) -> tuple[float, list[int]]:
    """Seconds to the first streamed chunk, and the whole output."""
    body = {"rid": rid, "input_ids": prompt, "sampling_params": {"max_new_tokens": 8}, "stream": True}
    t0 = time.perf_counter()
    first: float | None = None
    out: list[int] = []
    async with http.post(url + "/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            payload = line.removeprefix(b"data: ").strip()
            if not payload or payload == b"[DONE]":
                continue
            if first is None:
                first = time.perf_counter() - t0
            out.extend(decode_chunk(payload).output_ids)
    assert first is not None
    return first, out


async def test_restart_drafts_then_serves_with_no_second_stall() -> None:
    prompt = [32 + j % 90 for j in range(400)]
    s = spec(restart=True, draft_load_s=10.0, model_load_s=40.0)  # 0.1 s, then 0.4 s from start
    async with aiohttp.ClientSession() as http:
        async with start_worker(spec("fresh")) as fresh:
            await ttft(http, fresh.url, "warm", prompt)  # warm the client's connection pool
            fresh_ttft, want = await ttft(http, fresh.url, "fresh", prompt)

        loop = asyncio.get_running_loop()
        async with start_worker(s) as w:
            t0 = loop.time()
            phases: list[tuple[float, Phase]] = [(0.0, w.engine.phase)]
            endpoint = w.engine.assist.endpoint
            assert endpoint.startswith("tcp://127.0.0.1:")  # bound before attach: Hello carries it
            refused = {"rid": "early", "input_ids": prompt, "sampling_params": {"max_new_tokens": 4}}
            async with http.post(w.url + "/generate", json=refused) as resp:
                assert resp.status == 503 and (await resp.json())["error"]["code"] == "not_serving"

            # while the draft model loads, the drafter answers rounds with no drafts; the test is a
            # target the gateway made a member (its Members), with the drafter's key
            probe = PlaneAuth.generate()
            w.engine.planes.members.replace([member(w), Member("probe", 1, probe.keys.public)])
            client = DraftClient(endpoint, auth=probe, server_key=w.engine.planes.keys.public)
            drafted = False
            try:
                for r in range(1, 200):
                    client.request(r, [client.sync_item("x", prompt, 4)])
                    got = await client.poll(r, 0.02)
                    if got is not None:
                        break
                    await asyncio.sleep(0.002)  # a refused send (not connected yet) returns at once
                assert got is not None and got["x"].tokens == ()
                assert w.engine.phase is Phase.LOADING_DRAFT

                while w.engine.phase is not Phase.SERVING:
                    if w.engine.phase is not phases[-1][1]:
                        phases.append((loop.time() - t0, w.engine.phase))
                    if w.engine.phase is Phase.DRAFT_READY and not drafted:
                        client.request(1000, [client.sync_item("x", prompt, 4)])
                        got = await client.poll(1000, 1.0)
                        assert got is not None and len(got["x"].tokens) == 4
                        drafted = True
                        async with http.post(w.url + "/generate", json=refused) as resp:
                            assert resp.status == 503  # DRAFT_READY only drafts
                    await asyncio.sleep(0.0005)
                phases.append((loop.time() - t0, w.engine.phase))
                # the first request after the switch is admitted at once: no load wait left
                restarted_ttft, got_ids = await ttft(http, w.url, "first", prompt)
            finally:
                client.close()
            assert got_ids == want
            assert [p for _, p in phases] == [Phase.LOADING_DRAFT, Phase.DRAFT_READY, Phase.SERVING]
            assert 0.09 <= phases[1][0] < 0.5 and 0.39 <= phases[2][0] < 0.9, phases
            assert restarted_ttft < 3 * fresh_ttft + 0.05, (restarted_ttft, fresh_ttft)
            # unpaired, the drafter retires once its rounds stop arriving
            await wait_until(lambda: w.engine.assist.endpoint == "")


async def test_a_plain_restart_still_loads_the_full_model_only() -> None:
    async with start_worker(spec(restart=True, draft_model="", model_load_s=20.0)) as w:
        assert w.engine.phase is Phase.LOADING_FULL and w.engine.assist.endpoint == ""
        await wait_until(lambda: w.engine.phase is Phase.SERVING)


# -- a target assisted by a drafter -----------------------------------------------------------------


def workload(n: int = 16, max_new: int = 200) -> list[GenerateRequest]:
    """Greedy and seeded requests of different lengths, one of them with a stop token."""
    reqs = []
    for i in range(n):
        prompt = [32 + (i * 7 + j) % 90 for j in range(50 + 10 * i)]
        greedy = i % 2 == 0
        params = SamplingParams(max_new_tokens=max_new, temperature=0.0 if greedy else 0.9, top_p=0.95)
        reqs.append(
            GenerateRequest(
                rid=f"r{i}", input_ids=prompt, sampling_params=params, lumen=LumenExt(seed_base=i + 1)
            )
        )
    if n > 3:
        want, _ = expected_output(reqs[3].input_ids, reqs[3].sampling_params, 4)
        reqs[3].sampling_params.stop_token_ids.append(want[max_new // 2])
    return reqs


def expected(req: GenerateRequest) -> list[int]:
    assert req.lumen is not None
    return expected_output(req.input_ids, req.sampling_params, req.lumen.seed_base)[0]


async def drain(handle: RequestHandle) -> tuple[list[int], list[int]]:
    """The output, and how many ids each emission carried."""
    out: list[int] = []
    sizes: list[int] = []
    while True:
        e = await handle.next()
        out.extend(e.new_ids)
        sizes.append(len(e.new_ids))
        if e.finish is not None:
            return out, sizes


async def run(w: Worker, reqs: list[GenerateRequest]) -> list[list[int]]:
    # submitted together before the loop runs: the same batches, steps and outputs every run
    handles = [w.engine.submit(r) for r in reqs]
    return [out for out, _ in await asyncio.gather(*(drain(h) for h in handles))]


def pair(target: Worker, drafter: Worker, k: int = 4) -> None:
    """What the gateway's coordinator sends, applied through the agents' command handler."""
    introduce(target, drafter)  # and its Members before: the two trust each other's keys
    for w, peer, role in ((target, drafter, "target"), (drafter, target, "drafter")):
        Agent(w.spec, w.engine, w.url).handle(
            pb.GatewayMessage(
                start_draft_assist=pb.StartDraftAssist(
                    peer_id=peer.worker_id, peer_endpoint=peer.engine.assist.endpoint, role=role, k=k
                )
            )
        )


@contextlib.asynccontextmanager
async def assisted(agreement: float) -> AsyncIterator[tuple[Worker, Worker]]:
    async with start_worker(drafter_spec(agreement)) as d, start_worker(spec("t")) as t:
        await wait_until(lambda: d.engine.phase is Phase.DRAFT_READY)
        pair(t, d)
        assert d.engine.assist.drafter is not None and d.engine.assist.drafter.peers == {"t"}
        yield t, d


@pytest.fixture(scope="module")
def plain_steps() -> dict[str, float]:
    """The non-assisted run of `workload()`: steps and modelled time."""

    async def go() -> dict[str, float]:
        async with start_worker(spec("plain")) as w:
            outs = await run(w, workload())
            assert outs == [expected(r) for r in workload()]
            s = w.engine.stats()
            return {"steps": s.steps_total, "modelled": s.modelled_s_total}

    return asyncio.run(go())


async def test_assisted_outputs_are_exact_with_more_than_one_token_per_step(
    plain_steps: dict[str, float],
) -> None:
    reqs = workload()
    async with assisted(0.7) as (t, d):
        handles = [t.engine.submit(r) for r in reqs]
        results = await asyncio.gather(*(drain(h) for h in handles))
        assert [out for out, _ in results] == [expected(r) for r in reqs]
        assert max(max(sizes) for _, sizes in results) > 1  # multi-token steps reached the streams
        sp = t.engine.assist.speculator
        assert sp is not None
        st = sp.client.stats
        tokens_per_step = 1 + st.accepted / st.verified_rounds  # per assisted request and step
        steps = t.engine.stats().steps_total
        print(
            f"agreement 0.7: acceptance {st.acceptance:.3f}, {tokens_per_step:.2f} tokens per assisted "
            f"request-step, {steps} target steps vs {plain_steps['steps']:.0f} unassisted, final k {sp.k}"
        )
        assert st.acceptance is not None and 0.6 < st.acceptance < 0.8
        assert tokens_per_step > 1.5
        assert steps < 0.8 * plain_steps["steps"]
        assert t.engine.stats().modelled_s_total < plain_steps["modelled"]
        totals = t.engine.assist.totals()
        assert (totals.drafted, totals.accepted) == (st.drafted, st.accepted) and totals.rounds > 10
        assert d.engine.stats().requests_total == 0  # the drafter only drafted


async def test_agreement_zero_is_exact_and_costs_only_verification(plain_steps: dict[str, float]) -> None:
    reqs = workload()
    async with assisted(0.0) as (t, _):
        assert await run(t, reqs) == [expected(r) for r in reqs]
        sp = t.engine.assist.speculator
        assert sp is not None and sp.client.stats.accepted == 0 and sp.client.stats.drafted > 0
        s = t.engine.stats()
        # every draft rejected: one token per step as without assist; drafting paused after warm-up
        # (probes only), so the verification cost is all it added
        assert s.steps_total == plain_steps["steps"]
        assert plain_steps["modelled"] <= s.modelled_s_total < 1.01 * plain_steps["modelled"]
        assert sp.client.stats.rounds < s.steps_total / 10


async def test_target_goes_on_alone_when_the_drafter_dies_mid_assist() -> None:
    reqs = workload(max_new=300)
    async with contextlib.AsyncExitStack() as stack:
        d = await stack.enter_async_context(start_worker(drafter_spec()))
        t = await stack.enter_async_context(start_worker(spec("t")))
        await wait_until(lambda: d.engine.phase is Phase.DRAFT_READY)
        pair(t, d)
        handles = [t.engine.submit(r) for r in reqs]
        sp = t.engine.assist.speculator
        assert sp is not None
        await wait_until(lambda: sp.client.stats.accepted > 100)
        await d.engine.stop()  # the drafter process dies: its socket closes
        steps = t.engine.stats().steps_total
        results = await asyncio.gather(*(drain(h) for h in handles))
        assert [out for out, _ in results] == [expected(r) for r in reqs]
        assert t.engine.stats().steps_total > steps + 50  # it went on decoding alone
        st = sp.client.stats
        assert st.timeouts <= MAX_MISSES and st.unsent >= 1, st  # no stall waiting for a dead peer


async def test_stop_draft_assist_ends_the_pair_and_keeps_the_totals() -> None:
    async with assisted(0.7) as (t, d):
        reqs = workload(4, max_new=60)
        assert await run(t, reqs) == [expected(r) for r in reqs]
        totals = t.engine.assist.totals()
        assert totals.accepted > 0
        for w, peer in ((t, d), (d, t)):
            Agent(w.spec, w.engine, w.url).handle(
                pb.GatewayMessage(stop_draft_assist=pb.StopDraftAssist(peer_id=peer.worker_id))
            )
        assert t.engine.assist.speculator is None and t.engine.assist.totals() == totals
        assert d.engine.assist.drafter is not None and not d.engine.assist.drafter.peers
        more = workload(2, max_new=40)
        assert await run(t, more) == [expected(r) for r in more]
        assert t.engine.assist.totals() == totals


async def test_ending_the_pair_while_the_target_awaits_drafts_does_not_stop_its_loop() -> None:
    # a slow drafter (real-time draft steps) and a patient target: the loop sits in `collect`
    slow = drafter_spec(time_scale=1.0)
    async with start_worker(slow) as d, start_worker(spec("t", draft_timeout_ms=200)) as t:
        await wait_until(lambda: d.engine.phase is Phase.DRAFT_READY)
        reqs = workload(4, max_new=300)
        for _ in range(3):
            pair(t, d)
            sp = t.engine.assist.speculator
            assert sp is not None
            handles = [t.engine.submit(r) for r in reqs]
            await wait_until(lambda sp=sp: sp._collecting)
            Agent(t.spec, t.engine, t.url).handle(
                pb.GatewayMessage(stop_draft_assist=pb.StopDraftAssist(peer_id="d"))
            )
            assert t.engine.assist.speculator is None
            outs = await asyncio.wait_for(asyncio.gather(*(drain(h) for h in handles)), 10)
            assert [out for out, _ in outs] == [expected(r) for r in reqs]


# -- the gateway's choice: draft first or not -------------------------------------------------------


@pytest.mark.parametrize("pays", [True, False])
async def test_a_restart_loads_its_draft_first_only_if_the_gateway_says_it_pays(pays: bool) -> None:
    # the gateway's gate (app._draft_first: pairing.draft_first_pays) answers the restart's Hello;
    # told to skip, the worker is a plain restart: LOADING_FULL, serving when one without a draft would
    monitor = LoadMonitor(clock=time.monotonic, heartbeat_interval_s=0.02, heartbeat_misses=50)
    control = ControlService(monitor, token="", heartbeat_interval_ms=20)
    asked: list[str] = []

    def draft_first(worker_id: str) -> bool:
        asked.append(worker_id)
        return pays

    control.draft_first = draft_first
    server, port = await start_control_server(control, "127.0.0.1", 0)
    try:
        # the draft would be ready at 0.5 s (time_scale 0.01), well after the Welcome; plain: 1 s
        s = spec(
            "d", restart=True, draft_load_s=50.0, model_load_s=100.0, control_address=f"127.0.0.1:{port}"
        )
        loop = asyncio.get_running_loop()
        async with start_worker(s) as w:
            t0 = loop.time()
            await wait_until(lambda: asked == ["d"])
            seen = {w.engine.phase}
            while w.engine.phase is not Phase.SERVING:
                seen.add(w.engine.phase)
                await asyncio.sleep(0.001)
            served = loop.time() - t0
        if pays:
            assert Phase.DRAFT_READY in seen
        else:
            assert Phase.DRAFT_READY not in seen and Phase.LOADING_FULL in seen
            assert served < 1.0 + 0.4  # when the plain restart serves (1 s), start-up noise allowed
    finally:
        await server.stop(None)
