"""End-to-end helpers: real `lumen cluster up` processes on loopback, real streaming clients."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from loadtests.client import RequestResult, stream_completion
from loadtests.cluster_proc import ClusterProcess
from loadtests.demo import expected_text

# Robust on a loaded 2-core CI box: a late heartbeat must not fence a healthy worker. Kill -9 is
# still detected at once (the control stream breaks); hangs take interval x misses.
E2E_OVERRIDES: dict[str, Any] = {
    "engine.time_scale": 1.0,
    "engine.model_load_s": 1.5,
    "health.heartbeat_interval_ms": 50,
    "health.heartbeat_misses": 4,
    "gateway.log_level": "info",
    # a stopping gateway cancels its workers' control streams after 0.05 s, not 0.5 s (each test's teardown)
    "timeouts.control_stop_grace_s": 0.05,
}


@pytest.fixture
def cluster_factory(tmp_path: Path) -> Iterator[Any]:
    started: list[ClusterProcess] = []

    def start(workers: int = 3, mode: str = "stop_restart", **overrides: Any) -> ClusterProcess:
        c = ClusterProcess(
            workers=workers,
            mode=mode,
            overrides={**E2E_OVERRIDES, **overrides},
            log_dir=tmp_path / f"c{len(started)}",
        )
        c.__enter__()
        started.append(c)
        return c

    yield start
    for c in started:
        c.stop()


def make_requests(n: int, seed: int, *, min_out: int = 60, max_out: int = 160) -> list[RequestResult]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        greedy = i % 2 == 0
        out.append(
            RequestResult(
                idx=i,
                arrival=0.0,
                prompt_ids=[rnd.randrange(32, 127) for _ in range(rnd.randrange(16, 400))],
                max_tokens=rnd.randrange(min_out, max_out),
                temperature=0.0 if greedy else 0.9,
                seed=None if greedy else rnd.randrange(1, 2**31),
            )
        )
    return out


def assert_exact(results: list[RequestResult]) -> None:
    """No client-visible error, and every output equals the synthetic model's no-failure output."""
    bad = [(r.idx, r.status, r.error) for r in results if not r.ok]
    assert bad == [], f"client-visible errors: {bad[:5]}"
    wrong = [r.idx for r in results if r.text != expected_text(r)]
    assert wrong == [], f"outputs differ from the no-failure run: {wrong[:10]}"


async def run_requests(url: str, reqs: list[RequestResult]) -> list[RequestResult]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        return list(await asyncio.gather(*(stream_completion(http, url, "lumen-synthetic", r) for r in reqs)))


async def admin(url: str, method: str, path: str) -> Any:
    async with aiohttp.ClientSession() as http, http.request(method, url + path) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def wait_for(url: str, pred: Any, timeout_s: float = 30.0, what: str = "condition") -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        ws = await admin(url, "GET", "/admin/workers")
        if pred(ws):
            return ws
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}: {ws}")


async def kill_busiest(
    url: str, mode: str = "kill", min_running: int = 1, exclude: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Wait until some worker (not in `exclude`) runs >= min_running requests, then kill the busiest."""

    def candidates(ws: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [w for w in ws if w["state"] == "HEALTHY" and w["id"] not in exclude]

    ws = await wait_for(url, lambda ws: any(w["running"] >= min_running for w in candidates(ws)), 20, "load")
    busiest = max(candidates(ws), key=lambda w: (w["running"] + w["waiting"], w["id"]))
    res = await admin(url, "POST", f"/admin/workers/{busiest['id']}/kill?mode={mode}")
    return {**res, "victim": busiest}
