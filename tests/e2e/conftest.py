"""End-to-end helpers: real `lumen cluster up` processes on loopback, real streaming clients."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.protocol.secrets import admin_headers
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


SHARED_WORKERS = 3


@pytest.fixture(scope="session")
def _shared_clusters() -> Iterator[dict[str, ClusterProcess]]:
    running: dict[str, ClusterProcess] = {}
    yield running
    for c in running.values():
        c.stop()


@pytest.fixture
def shared_cluster(
    request: pytest.FixtureRequest,
    _shared_clusters: dict[str, ClusterProcess],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ClusterProcess]:
    """`lumen cluster up` with 3 workers in stop_restart and E2E_OVERRIDES, one for every test that takes
    it (a start and a stop each saved): started by the first of them, stopped after the last. Such a test
    leaves the cluster as it found it (every worker HEALTHY: a worker it killed or hung has come back)
    and reads the cluster's history only for its own victims (their incarnations) or as differences;
    each gets its 3 workers HEALTHY, else a fresh cluster."""
    c = _shared_clusters.get("stop_restart")
    if c is not None and not _all_healthy(c):
        c.stop()
        c = None
    if c is None:
        c = ClusterProcess(
            workers=SHARED_WORKERS,
            mode="stop_restart",
            overrides=E2E_OVERRIDES,
            log_dir=tmp_path_factory.mktemp("shared-cluster"),
        )
        c.__enter__()
        _shared_clusters["stop_restart"] = c
    yield c
    items = request.session.items
    later = items[items.index(request.node) + 1 :] if request.node in items else []
    if not any("shared_cluster" in getattr(i, "fixturenames", ()) for i in later):
        c.stop()  # its last user: not left running through the tests that follow
        del _shared_clusters["stop_restart"]


def _all_healthy(c: ClusterProcess, within_s: float = 30.0) -> bool:
    """Whether the cluster runs and all its workers are (or within `within_s` become) HEALTHY."""
    deadline = time.monotonic() + within_s
    while c.proc is not None and c.proc.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            req = urllib.request.Request(c.url + "/admin/workers", headers=admin_headers(c.url))
            with urllib.request.urlopen(req, timeout=5) as resp:
                ws = json.loads(resp.read())
            if len(ws) == SHARED_WORKERS and all(w["state"] == "HEALTHY" for w in ws):
                return True
        time.sleep(0.05)
    return False


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
    async with (
        aiohttp.ClientSession() as http,
        http.request(method, url + path, headers=admin_headers(url)) as resp,
    ):
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
