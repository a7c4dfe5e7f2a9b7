"""The local supervisor's hung-worker rule against gateways in other processes (`follow_gateways`):
stand-in gateways serve /admin/workers and /admin/events, a stand-in worker is a sleeping process."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

from aiohttp import web

from gateway.cluster.supervisor import LocalCluster
from gateway.protocol.launch import EngineSpec

GRACE = 0.4


class StandinGateway:
    def __init__(self) -> None:
        self.workers: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        async def workers(request: web.Request) -> web.Response:
            return web.json_response(self.workers)

        async def events(request: web.Request) -> web.Response:
            return web.json_response(self.events)

        app = web.Application()
        app.router.add_get("/admin/workers", workers)
        app.router.add_get("/admin/events", events)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def failed(self, pid: int, reason: str, incarnation: int = 7) -> None:
        self.workers = [{"id": "w0", "state": "FAILED", "pid": pid, "incarnation": incarnation}]
        self.events = [{"worker": "w0", "incarnation": incarnation, "to": "FAILED", "reason": reason}]


async def setup(
    tmp_path: Path, n: int = 2
) -> tuple[LocalCluster, list[StandinGateway], asyncio.subprocess.Process]:
    cluster = LocalCluster(
        [EngineSpec(worker_id="w0", control_address="")], log_dir=tmp_path, hung_restart_grace_s=GRACE
    )
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(60)")
    cluster.workers["w0"].proc = proc  # the supervise loop is not running: nothing restarts it here
    gws = [StandinGateway() for _ in range(n)]
    for g in gws:
        await g.start()
    return cluster, gws, proc


async def follow_for(cluster: LocalCluster, gws: list[StandinGateway], seconds: float) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(cluster.follow_gateways([g.url for g in gws], stop, poll_s=0.05))
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.wait_for(task, 5)


async def test_a_worker_every_gateway_failed_by_silence_is_killed_after_the_grace(tmp_path: Path) -> None:
    cluster, gws, proc = await setup(tmp_path)
    try:
        for g in gws:
            g.failed(
                proc.pid, "no heartbeat for 212 ms (fail after 80 ms) and no answer to a probe for 152 ms"
            )
        await follow_for(cluster, gws, GRACE + 0.5)
        assert await asyncio.wait_for(proc.wait(), 5) == -9
        assert cluster.workers["w0"].hung_restarts == 1
    finally:
        for g in gws:
            await g.stop()


async def test_no_kill_while_a_gateway_still_hears_it_or_the_stream_broke(tmp_path: Path) -> None:
    cluster, gws, proc = await setup(tmp_path)
    try:
        # one gateway failed it by silence, the other still gets its heartbeats: not hung
        gws[0].failed(
            proc.pid, "no heartbeat for 212 ms (fail after 80 ms) and no answer to a probe for 152 ms"
        )
        gws[1].workers = [{"id": "w0", "state": "HEALTHY", "pid": proc.pid, "incarnation": 7}]
        await follow_for(cluster, gws, GRACE + 0.4)
        # failed by a broken stream on both (the process exits by itself; restarted by _supervise)
        for g in gws:
            g.failed(proc.pid, "control stream ended")
        await follow_for(cluster, gws, GRACE + 0.4)
        # the FAILED record is another process's (an older one): not ours to kill
        for g in gws:
            g.failed(proc.pid + 100_000, "no heartbeat for 300 ms (fail after 80 ms)")
        await follow_for(cluster, gws, GRACE + 0.4)
        assert proc.returncode is None and cluster.workers["w0"].hung_restarts == 0
    finally:
        proc.kill()
        await proc.wait()
        for g in gws:
            await g.stop()


async def test_grace_zero_means_never(tmp_path: Path) -> None:
    cluster, gws, proc = await setup(tmp_path, n=1)
    cluster.hung_restart_grace_s = 0.0
    try:
        gws[0].failed(proc.pid, "no heartbeat for 212 ms (fail after 80 ms)")
        await asyncio.wait_for(cluster.follow_gateways([gws[0].url], asyncio.Event()), 1)  # returns at once
        assert proc.returncode is None
    finally:
        proc.kill()
        await proc.wait()
        await gws[0].stop()
