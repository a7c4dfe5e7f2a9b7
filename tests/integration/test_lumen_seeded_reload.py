"""Seeded reload on Lumen's own workers (worker_hooks/engine/seeding.py): a restart started with
`reload_from_peer` asks the gateway for a seed, takes the peer's load time once one is named, slows
its seed for the transfer, reports how it went, and finishes from storage if the seed dies mid-way.

A gateway in process and Lumen workers in process (synthetic backend); a "restart" is a new worker
process's engine with `restart=True` under the same worker id, after the old one stopped."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from gateway.cluster.supervisor import worker_specs
from gateway.config import load_config
from gateway.core.costmodel import CostModel, ReloadSource
from gateway.core.health import Phase, WorkerState
from gateway.protocol.launch import EngineSpec
from gateway.protocol.secrets import worker_http_bearer
from gateway.server.app import Gateway
from tests.integration.test_sglang_agent import TOKEN, gateway, state_event, to
from worker_hooks.engine.loading import LoadPlan, fallback_plan, load_plan, peer_weights_s, plain_plan
from worker_hooks.engine.service import Worker, start_worker
from worker_hooks.engine.stepping import StepLoop

MODEL = "Qwen3-32B"  # its peer transfer is 0.73 modelled s: long enough to break on purpose
COST = CostModel.preset(MODEL, "H100-80G")


def spec(worker_id: str, gw: Gateway | None = None, **kw: Any) -> EngineSpec:
    base: dict[str, Any] = {
        "control_address": f"127.0.0.1:{gw.control_port}" if gw is not None else "",
        "control_token": TOKEN if gw is not None else "",
        "model": MODEL,
        "page_size": 16,
        "heartbeat_interval_ms": 50,
        "log_level": "warning",
    }
    return EngineSpec(worker_id=worker_id, **(base | kw))


async def until(cond: Any, within: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not cond():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


# -- the plans --------------------------------------------------------------------------------------


def test_a_peer_plan_takes_the_peer_load_time_and_the_draft_still_from_storage() -> None:
    # the cost model's peer load: start-up plus the weights at peer bandwidth
    auto = load_plan(spec("w", restart=True), COST, ReloadSource.PEER)
    assert auto == LoadPlan(Phase.LOADING_FULL, ((COST.load_time(source=ReloadSource.PEER), Phase.SERVING),))
    assert auto.serving_s < load_plan(spec("w", restart=True), COST).serving_s  # 20.7 s vs 36.4 s
    over = spec("w", restart=True, peer_load_s=3.0, model_load_s=9.0, time_scale=0.5)
    assert plain_plan(over, COST, ReloadSource.PEER) == LoadPlan(Phase.LOADING_FULL, ((1.5, Phase.SERVING),))
    # a draft first from storage, then the full weights from the seed (the simulator's timeline),
    # never serving sooner than a plain seeded restart would (core seeded_draft_first_serving_s)
    drafting = spec("w", restart=True, draft_model="Qwen3-1.7B", draft_load_s=2.5, peer_load_s=3.0)
    plan = load_plan(drafting, COST, ReloadSource.PEER)
    assert plan.first is Phase.LOADING_DRAFT
    assert plan.changes == ((2.5, Phase.DRAFT_READY), (2.5 + peer_weights_s(drafting, COST), Phase.SERVING))
    quick = spec("w", restart=True, draft_model="Qwen3-1.7B", draft_load_s=1.0, peer_load_s=3.0)
    assert load_plan(quick, COST, ReloadSource.PEER).changes == (
        (1.0, Phase.DRAFT_READY),
        (3.0, Phase.SERVING),
    )
    # a draft that the peer's full model would beat is not loaded first
    late = spec("w", restart=True, draft_model="Qwen3-1.7B", draft_load_s=5.0, peer_load_s=3.0)
    assert not load_plan(late, COST, ReloadSource.PEER).drafts and load_plan(late, COST).drafts
    # the transfer is the load's last part, never longer than the load
    assert peer_weights_s(spec("w"), COST) == pytest.approx(COST.weights_time(ReloadSource.PEER))
    assert peer_weights_s(spec("w", peer_load_s=0.2), COST) == 0.2


def test_a_lost_seed_leaves_the_rest_of_the_weights_to_storage_without_a_second_start_up() -> None:
    s = spec("w", restart=True, time_scale=2.0)
    plan = fallback_plan(s, COST, Phase.LOADING_FULL, 1.25)
    assert plan == LoadPlan(Phase.LOADING_FULL, ((1.25 + 2.0 * COST.weights_time(), Phase.SERVING),))
    # never longer than the whole storage load it replaces (a short modelled load in tests)
    short = spec("w", restart=True, model_load_s=0.5)
    assert fallback_plan(short, COST, Phase.DRAFT_READY, 0.1) == LoadPlan(
        Phase.DRAFT_READY, ((0.6, Phase.SERVING),)
    )


async def test_a_seed_sends_slower_while_it_sends_and_refuses_bad_bodies() -> None:
    async with start_worker(spec("seed")) as w, aiohttp.ClientSession() as http:
        steps: StepLoop = w.engine.steps
        send = asyncio.create_task(
            http.post(w.url + "/lumen/seed_send", json={"seconds": 0.3, "slowdown": 1.5})
        )
        await until(lambda: w.engine.seeding.sending == 1)
        assert steps.factor == 1.5
        resp = await send
        assert resp.status == 200 and (await resp.json())["sent_s"] == 0.3
        assert steps.factor == 1.0 and w.engine.seeding.sends_total == 1
        for bad in ({"seconds": -1, "slowdown": 1.5}, {"seconds": 1, "slowdown": 0.5}, {"seconds": 1}):
            async with http.post(w.url + "/lumen/seed_send", json=bad) as r:
                assert r.status == 400 and "error" in await r.json()


# -- through the gateway ----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def workers(gw: Gateway, *ids: str) -> AsyncIterator[dict[str, Worker]]:
    async with contextlib.AsyncExitStack() as stack:
        out = {wid: await stack.enter_async_context(start_worker(spec(wid, gw))) for wid in ids}
        for wid in ids:
            await state_event(gw, to(wid, WorkerState.HEALTHY))
        yield out


async def test_a_restart_loads_from_the_seed_the_gateway_names_and_reports_it() -> None:
    async with gateway() as gw, workers(gw, "w1", "w2") as ws:
        # w0 restarts (its old incarnation is gone): 30 modelled s from storage, 2 from a peer (x 1/4)
        restart = spec(
            "w0", gw, restart=True, reload_from_peer=True, model_load_s=30.0, peer_load_s=2.0, time_scale=0.25
        )
        async with start_worker(restart) as w0:
            back = await state_event(gw, to("w0", WorkerState.HEALTHY), within=10)
            choice = gw.reload.choices[-1]
            assert (choice.worker, choice.seed, choice.seed_url) == ("w0", "w1", ws["w1"].url)  # tie: by id
            assert w0.engine.seeding.report is not None
            assert w0.engine.seeding.report.source == "peer" and w0.engine.seeding.report.seed == "w1"
            assert 2.0 <= w0.engine.seeding.report.seconds < 5.0  # the peer's 2 s, not storage's 30
            # the seed's side ends with the transfer, around when w0 serves
            await until(lambda: ws["w1"].engine.seeding.sends_total == 1)
            assert ws["w2"].engine.seeding.sends_total == 0
            assert ws["w1"].engine.steps.factor == 1.0  # the seed's slowdown ended with the transfer
            rec = gw.monitor.workers["w0"]
            assert (rec.reload_source, rec.reload_seed) == ("peer", "w1")
            assert "reloaded from w1 (peer)" in back.reason, back.reason
            assert w0.engine.phase is Phase.SERVING
            async with aiohttp.ClientSession() as http:  # what an operator's scrape sees
                headers = {"Authorization": f"Bearer {worker_http_bearer(TOKEN)}"}
                async with http.get(ws["w1"].url + "/metrics", headers=headers) as r:
                    assert f'lumen_seed_sends_total{{model_name="{MODEL}"}} 1.0' in await r.text()
                async with http.get(w0.url + "/metrics", headers=headers) as r:
                    text = await r.text()
                    line = next(x for x in text.splitlines() if x.startswith("lumen_reload_seconds{"))
                    assert 2.0 <= float(line.split()[-1]) < 5.0, line


async def test_no_seed_named_means_storage() -> None:
    async with gateway() as gw:
        restart = spec("w0", gw, restart=True, reload_from_peer=True, model_load_s=0.4, peer_load_s=0.1)
        async with start_worker(restart) as w0:  # alone: nobody to seed it
            await state_event(gw, to("w0", WorkerState.HEALTHY), within=10)
            report = w0.engine.seeding.report
            assert report is not None and (report.source, report.seed) == ("disk", "")
            assert report.seconds >= 0.4
            assert gw.reload.choices[-1].seed is None


async def test_a_seed_lost_mid_transfer_leaves_the_rest_to_storage() -> None:
    async with gateway() as gw, contextlib.AsyncExitStack() as stack:
        seed_stack = contextlib.AsyncExitStack()
        seed = await seed_stack.enter_async_context(start_worker(spec("w1", gw)))
        stack.push_async_callback(seed_stack.aclose)
        await state_event(gw, to("w1", WorkerState.HEALTHY))
        # peer: 1.0 modelled s, the transfer its last 0.73; storage: 1.0 s of weights
        restart = spec("w0", gw, restart=True, reload_from_peer=True, model_load_s=1.0, peer_load_s=1.0)
        w0 = await stack.enter_async_context(start_worker(restart))
        await until(lambda: seed.engine.seeding.sending == 1)  # the transfer began
        await seed_stack.aclose()  # the seed dies mid-transfer
        await state_event(gw, to("w0", WorkerState.HEALTHY), within=15)
        report = w0.engine.seeding.report
        assert report is not None and (report.source, report.seed) == ("peer>disk", "w1")
        assert report.seconds > 1.0  # later than the peer plan's 1.0 s: the rest came from storage


async def test_a_torch_restart_takes_the_seed_named_while_it_loads_its_model() -> None:
    """The torch backend loads its model at the start of the plan's last step; a ReloadFrom that lands
    meanwhile still shortens the wait (the plan is re-read at once, the model not loaded twice)."""
    pytest.importorskip("torch")
    async with gateway() as gw, workers(gw, "w1"):
        restart = spec(
            "w0", gw, backend="torch", torch_model="tiny", torch_draft="", restart=True,
            reload_from_peer=True, model_load_s=30.0, peer_load_s=0.5,
        )  # fmt: skip
        async with start_worker(restart) as w0:
            await state_event(gw, to("w0", WorkerState.HEALTHY), within=20)
            report = w0.engine.seeding.report
            assert report is not None and (report.source, report.seed) == ("peer", "w1")
            assert report.seconds < 10.0  # not storage's 30 s
            assert w0.engine.torch is not None and w0.engine.torch.model is not None


def test_the_cluster_config_reaches_every_worker_spec() -> None:
    plain = worker_specs(load_config(), "127.0.0.1:1", (259, 32, 127))
    assert not any(s.reload_from_peer for s in plain) and all(s.peer_load_s is None for s in plain)
    cfg = load_config(overrides={"engine.reload": "peer", "engine.peer_load_s": 6.8})
    assert all(
        s.reload_from_peer and s.peer_load_s == 6.8 for s in worker_specs(cfg, "127.0.0.1:1", (259, 32, 127))
    )
