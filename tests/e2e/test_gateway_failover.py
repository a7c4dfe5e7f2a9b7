"""A gateway killed -9 mid-stream loses nothing (issue 16): `lumen cluster up --gateways 2`, 16 streams on
gateway 0, gateway 0 killed; every client re-sends its request to gateway 1 with `Last-Event-ID` and its
text equals the no-failure text. The requests whose worker is alive are adopted there (not recomputed);
with a worker killed at the same moment, its requests are replayed and still exact. The supervisor
restarts the killed gateway, and the workers kept serving meanwhile."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from loadtests.client import RequestResult, stream_completion
from loadtests.cluster_proc import ClusterProcess
from tests.e2e.conftest import E2E_OVERRIDES, admin, assert_exact, make_requests


def metric(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (not want or f"{{{want}}}" in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def drive_and_kill(c: ClusterProcess, reqs: list[RequestResult], kill_worker: bool) -> dict[str, Any]:
    urls = c.ready["urls"]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as http:
        tasks = [
            asyncio.create_task(stream_completion(http, urls[0], "lumen-synthetic", r, resume_urls=[urls[1]]))
            for r in reqs
        ]
        async with asyncio.timeout(60):  # mid-stream: every client has some text
            while not all(len(r.chunk_times) >= 5 for r in reqs):
                await asyncio.sleep(0.02)
        victim = None
        if kill_worker:  # the busiest worker, at the same moment, through the surviving gateway
            ws = await admin(urls[1], "GET", "/admin/workers")
            victim = max(ws, key=lambda w: w["running"])["id"]
        os.kill(c.ready["gateway_pids"][0], signal.SIGKILL)
        if victim is not None:
            await admin(urls[1], "POST", f"/admin/workers/{victim}/kill?mode=kill")
        await asyncio.gather(*tasks)
        async with http.get(urls[1] + "/metrics") as resp:
            metrics = await resp.text()
        # the supervisor brings gateway 0 back on its port; the workers re-attach to it
        async with asyncio.timeout(60):
            while True:
                try:
                    async with http.get(urls[0] + "/health") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
    return {"metrics": metrics, "victim": victim}


@pytest.mark.parametrize(
    "kill_worker",
    # the gateway-only case runs by default; with a worker killed too, in the slow suite (CI's second step)
    [False, pytest.param(True, marks=pytest.mark.slow)],
    ids=["gateway", "gateway+worker"],
)
def test_a_gateway_killed_mid_stream_loses_no_token(tmp_path: Path, kill_worker: bool) -> None:
    reqs = make_requests(16, seed=16, min_out=150, max_out=220)
    overrides = {**E2E_OVERRIDES, "recovery.mode": "lumen"}
    with ClusterProcess(workers=3, gateways=2, overrides=overrides, log_dir=tmp_path) as c:
        out = asyncio.run(drive_and_kill(c, reqs, kill_worker))
    assert_exact(reqs)
    assert all(r.resumes == 1 for r in reqs), [r.resumes for r in reqs]
    adopted = metric(out["metrics"], "lumen_stream_resumes_total", how="adopt")
    replayed = metric(out["metrics"], "lumen_stream_resumes_total", how="replay")
    assert adopted + replayed == len(reqs)
    if kill_worker:
        assert replayed >= 1 and adopted >= 1  # the dead worker's requests recomputed, the rest adopted
    else:
        assert adopted == len(reqs)  # every worker alive: every request taken over where it ran


@pytest.mark.slow  # ~15-25 s of real processes; the main gateway-kill test stays in the default run
def test_a_fault_schedule_kills_a_gateway_and_the_load_resumes_elsewhere(tmp_path: Path) -> None:
    """`kill-gateway:0@T` from a fault schedule (FaultRunner), clients spread over both gateways."""
    from loadtests.faults import FaultRunner, FaultSchedule

    reqs = make_requests(12, seed=3, min_out=150, max_out=200)
    with ClusterProcess(workers=2, gateways=2, overrides=E2E_OVERRIDES, log_dir=tmp_path) as c:
        urls = c.ready["urls"]

        async def run() -> list[dict[str, Any]]:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as http:
                schedule = FaultSchedule.parse(["kill-gateway:0@1.5"])
                runner = FaultRunner(http, urls[0], schedule, seed=1, t0=time.monotonic(), gateway_urls=urls)
                load = [
                    stream_completion(http, urls[r.idx % 2], "lumen-synthetic", r, resume_urls=[urls[1 - r.idx % 2]])
                    for r in reqs
                ]
                await asyncio.gather(runner.run(), *load)
                return runner.fired

        fired = asyncio.run(run())
    assert [(f["kind"], f["ok"]) for f in fired] == [("kill-gateway", True)], fired
    assert_exact(reqs)
    assert sum(r.resumes for r in reqs) >= 1  # gateway 0's clients came back through gateway 1



@pytest.mark.slow  # ~15-25 s of real processes; the main gateway-kill test stays in the default run
def test_two_gateways_recover_one_worker_failure_each_for_its_own(tmp_path: Path) -> None:
    """A worker dies under two gateways' load: each gateway resumes its own requests, each once, and no
    holder's store ever exceeds its budget though both gateways assign holders at once."""
    reqs = make_requests(18, seed=21, min_out=150, max_out=220)
    # small pages, a light payload and a budget of a few requests' checkpoints per holder: the
    # stores evict under this load, so the budget is really tested
    overrides = {
        **E2E_OVERRIDES,
        "recovery.mode": "lumen",
        "engine.page_size": 16,
        "checkpoint.payload_scale": 0.001,
        "checkpoint.budget_bytes": 400 * 2**20,
    }
    with ClusterProcess(workers=3, gateways=2, overrides=overrides, log_dir=tmp_path) as c:
        urls = c.ready["urls"]

        async def run() -> tuple[list[list[dict[str, Any]]], list[tuple[int, int]], list[list[dict[str, Any]]]]:
            usage: list[tuple[int, int]] = []  # (bytes held, budget) as each gateway sees each worker
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as http:
                load = asyncio.gather(
                    *(stream_completion(http, urls[r.idx % 2], "lumen-synthetic", r) for r in reqs)
                )

                async def watch_budgets() -> None:
                    while True:
                        for u in urls:
                            ws = await admin(u, "GET", "/admin/workers")
                            usage.extend((w["ckpt_bytes"], w["ckpt_budget_bytes"]) for w in ws)
                        await asyncio.sleep(0.1)

                watcher = asyncio.create_task(watch_budgets())
                async with asyncio.timeout(60):
                    while not all(len(r.chunk_times) >= 5 for r in reqs):
                        await asyncio.sleep(0.02)
                ws = await admin(urls[0], "GET", "/admin/workers")
                victim = max(ws, key=lambda w: w["running"])["id"]
                await admin(urls[0], "POST", f"/admin/workers/{victim}/kill?mode=kill")
                await load
                watcher.cancel()
                sessions = [(await admin(u, "GET", "/admin/sessions"))["interrupted"] for u in urls]
                workers = [await admin(u, "GET", "/admin/workers") for u in urls]
            return sessions, usage, workers

        sessions, usage, workers = asyncio.run(run())
    assert_exact(reqs)
    for mine in sessions:
        rids = [s["rid"] for s in mine]
        assert rids and len(rids) == len(set(rids))  # each interrupted request resumed once, here
        assert all(s["resumed_on"] for s in mine)
    # disjoint: a gateway resumes only its own sessions
    assert not {s["rid"] for s in sessions[0]} & {s["rid"] for s in sessions[1]}
    assert usage and all(held <= budget for held, budget in usage if budget)
    evicted = sum(w["ckpt_pages_evicted_total"] for w in workers[1])
    assert max(held for held, _ in usage) > 0 and (evicted > 0 or any(2 * h > b for h, b in usage if b))
