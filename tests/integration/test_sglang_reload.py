"""Seeded fast reload: a killed SGLang server is relaunched by its agent loading its weights from the
least-loaded survivor the gateway names (`--load-format remote_instance`), or from storage.

A gateway in process, agents in process launching stand-ins through the launch shim
(tests/e2e/sglang_launch_shim.py), which records the flags of every start (`LUMEN_SHIM_RECORD`), checks
that seeded ones are complete and that the seed answers `/ready`, sleeps a simulated weight load
(`LUMEN_SHIM_LOAD_S_DISK` 0.6 s, `LUMEN_SHIM_LOAD_S_PEER` 0.1 s here) and can fail a seeded start
(`LUMEN_SHIM_SEED_FAILS`). The times printed are the mechanism's (agent backoff, polls, the simulated
loads), not SGLang's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.core.health import WorkerState
from gateway.core.load import estimated_load
from gateway.protocol import control_pb2 as pb
from gateway.server.app import Gateway
from tests.integration.test_sglang_agent import FAST, SHIM, free_url, gateway, heartbeat, state_event, to
from worker_hooks.sglang.agent import Sidecar
from worker_hooks.sglang.agent_config import SidecarConfig
from worker_hooks.sglang.launcher import WEIGHTS_GROUP_PORT_DELTA, host_port, server_command

LOAD_S = {"LUMEN_SHIM_LOAD_S_DISK": "0.6", "LUMEN_SHIM_LOAD_S_PEER": "0.1"}
PEER = {"engine.reload": "peer"}
CPU = [
    "--device",
    "cpu",
    "--enable-deterministic-inference",
]  # seeded reload is on only where the configuration says so


@contextlib.asynccontextmanager
async def agents(
    gw: Gateway,
    tmp: Path,
    *ids: str,
    env: dict[str, dict[str, str]] | None = None,
    args: dict[str, list[str]] | None = None,
    **kw: Any,
) -> AsyncIterator[dict[str, Sidecar]]:
    """Agents launching stand-ins through the recording shim (model "standin", TP 1), all HEALTHY."""
    async with contextlib.AsyncExitStack() as stack:
        out = {}
        for wid in ids:
            url = free_url()
            extra = ["--model-path", "standin", "--token-delay-ms", "25", *(args or {}).get(wid, [])]
            launch = server_command(url, extra, env={"LUMEN_SGLANG_LAUNCHER": " ".join(SHIM)})
            launch_env = {
                **os.environ,
                **LOAD_S,
                "LUMEN_SHIM_RECORD": str(tmp / f"{wid}.jsonl"),
                **(env or {}).get(wid, {}),
            }
            cfg = SidecarConfig(
                worker_id=wid,
                url=url,
                gateways=(f"127.0.0.1:{gw.control_port}",),
                model="standin",
                **{**FAST, "seed_wait_s": 2.0, **kw},
            )
            sc = Sidecar(cfg, launch=launch, launch_env=launch_env)
            await sc.start()
            stack.push_async_callback(sc.stop, 5.0)
            out[wid] = sc
        for wid in ids:
            await state_event(gw, to(wid, WorkerState.HEALTHY))
        yield out


def starts(tmp: Path, wid: str) -> list[dict[str, Any]]:
    """The flags of every start of `wid`'s server, as the shim recorded them."""
    path = tmp / f"{wid}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def kill(http: aiohttp.ClientSession, sc: Sidecar) -> None:
    async with http.post(sc.cfg.url + "/standin/fault", json={"kind": "kill"}) as resp:
        assert resp.status == 200


async def busy(http: aiohttp.ClientSession, sc: Sidecar, n: int) -> list[asyncio.Task[Any]]:
    """n long streams straight to the server (its own /v1/loads then reports them running)."""

    async def one() -> None:
        body = {"input_ids": [40, 41, 42], "sampling_params": {"max_new_tokens": 5000}, "stream": True}
        async with http.post(sc.cfg.url + "/generate", json=body) as resp:
            async for _ in resp.content:
                pass

    return [asyncio.create_task(one()) for _ in range(n)]


def timeline(gw: Gateway, wid: str, since: float) -> str:
    return "\n".join(
        f"  {ev.t - since:7.3f} s  {ev.src and ev.src.value} -> {ev.dst.value}: {ev.reason}"
        for ev in gw.monitor.events
        if ev.worker_id == wid and ev.t >= since
    )


async def test_a_killed_server_reloads_from_the_least_loaded_survivor(tmp_path: Path) -> None:
    async with (
        gateway(**PEER) as gw,
        agents(gw, tmp_path, "s0", "s1", "s2") as sc,
        aiohttp.ClientSession() as http,
    ):
        load = await busy(http, sc["s1"], 3)  # s1 busy, s2 idle: s2 is the seed
        await heartbeat(gw, lambda r, hb: r.id == "s1" and hb.running == 3)
        view = gw.monitor.view()
        assert estimated_load(view.workers["s2"], gw.load_params) < estimated_load(
            view.workers["s1"], gw.load_params
        )
        first = gw.monitor.workers["s0"].incarnation
        killed = asyncio.get_running_loop().time()
        await kill(http, sc["s0"])
        failed = await state_event(gw, to("s0", WorkerState.FAILED))
        restarting = await state_event(gw, to("s0", WorkerState.RESTARTING, newer_than=first))
        back = await state_event(gw, to("s0", WorkerState.HEALTHY, newer_than=first), within=20)
        for t in load:
            t.cancel()
        await asyncio.gather(*load, return_exceptions=True)

        # the gateway named s2, the relaunch got SGLang's remote-instance flags pointing at it
        choice = gw.reload.choices[-1]
        assert (choice.worker, choice.seed, choice.seed_url) == ("s0", "s2", sc["s2"].cfg.url)
        assert choice.incarnation == restarting.incarnation
        relaunch = starts(tmp_path, "s0")
        assert [s["load_format"] for s in relaunch] == ["auto", "remote_instance"]
        seed_host, seed_port = host_port(sc["s2"].cfg.url)
        own_port = host_port(sc["s0"].cfg.url)[1]
        assert (relaunch[1]["seed_ip"], relaunch[1]["seed_port"]) == (seed_host, seed_port)
        assert relaunch[1]["group_ports"] == [own_port + WEIGHTS_GROUP_PORT_DELTA]
        assert relaunch[1]["backend"] == "nccl"

        # FAILED -> RESTARTING -> HEALTHY, the reload in the timeline and the histogram
        assert failed.t < restarting.t < back.t
        assert "reloaded from s2 (peer) in" in back.reason, back.reason
        rec = gw.monitor.workers["s0"]
        assert rec.reload_source == "peer" and rec.reload_seed == "s2"
        assert rec.reload_seconds is not None and 0 < rec.reload_seconds < back.t - failed.t + 0.5
        reloaded = await sc["s0"].wait_event(lambda e: e["event"] == "reloaded", 1)
        assert reloaded["source"] == "peer" and reloaded["seed"] == "s2"
        assert b'lumen_reload_seconds_count{source="peer"} 1.0' in gw.metrics.render()
        assert "s2" not in gw.reload.seeding.values()  # the seed is free again
        print(
            f"\nkill -> FAILED {1000 * (failed.t - killed):.1f} ms, -> RESTARTING {restarting.t - killed:.3f} s, "
            f"-> HEALTHY {back.t - killed:.3f} s; agent's reload {rec.reload_seconds:.3f} s (peer, "
            f"simulated load 0.1 s)\n{timeline(gw, 's0', failed.t)}"
        )


@pytest.mark.slow  # the disk fallbacks; the default run keeps the seeded reload
async def test_a_seeded_server_that_fails_is_launched_again_from_storage(tmp_path: Path) -> None:
    async with (
        gateway(**PEER) as gw,
        # a busy machine can delay the seed's answer: the agent waits longer for it here
        agents(gw, tmp_path, "s0", "s1", env={"s0": {"LUMEN_SHIM_SEED_FAILS": "1"}}, seed_wait_s=5.0) as sc,
        aiohttp.ClientSession() as http,
    ):
        first = gw.monitor.workers["s0"].incarnation
        killed = asyncio.get_running_loop().time()
        await kill(http, sc["s0"])
        failed = await state_event(gw, to("s0", WorkerState.FAILED))
        back = await state_event(gw, to("s0", WorkerState.HEALTHY, newer_than=first), within=20)
        relaunches = starts(tmp_path, "s0")
        assert [s["load_format"] for s in relaunches] == ["auto", "remote_instance", "auto"]
        assert relaunches[1]["seed_port"] == host_port(sc["s1"].cfg.url)[1]
        assert "--load-format" not in relaunches[2]["argv"]  # the fallback names no seed at all
        await sc["s0"].wait_event(lambda e: e["event"] == "seed_failed" and e["seed"] == "s1", 1)
        assert "reloaded from storage (disk) in" in back.reason and "seed s1 failed" in back.reason
        rec = gw.monitor.workers["s0"]
        assert (rec.reload_source, rec.reload_seed) == ("disk", "s1")
        assert b'lumen_reload_seconds_count{source="disk"} 1.0' in gw.metrics.render()
        assert gw.reload.seeding == {}
        print(
            f"\nkill -> HEALTHY {back.t - killed:.3f} s; agent's reload {rec.reload_seconds:.3f} s (disk "
            f"after a failed seed)\n{timeline(gw, 's0', failed.t)}"
        )


@pytest.mark.slow  # the disk fallbacks; the default run keeps the seeded reload
async def test_a_seed_not_ready_in_time_is_killed_and_storage_used(tmp_path: Path) -> None:
    async with (
        gateway(**PEER) as gw,
        agents(
            gw, tmp_path, "s0", "s1", env={"s0": {"LUMEN_SHIM_LOAD_S_PEER": "30"}}, seed_timeout_s=1.5
        ) as sc,
        aiohttp.ClientSession() as http,
    ):
        first = gw.monitor.workers["s0"].incarnation
        await kill(http, sc["s0"])
        back = await state_event(gw, to("s0", WorkerState.HEALTHY, newer_than=first), within=20)
        timeout = await sc["s0"].wait_event(lambda e: e["event"] == "seed_timeout", 1)
        assert timeout["seed"] == "s1"
        assert [s["load_format"] for s in starts(tmp_path, "s0")] == ["auto", "remote_instance", "auto"]
        assert "(disk)" in back.reason and "seed s1 failed" in back.reason


@pytest.mark.slow  # the disk fallbacks; the default run keeps the seeded reload
async def test_with_no_survivor_of_the_same_deployment_it_loads_from_storage(tmp_path: Path) -> None:
    """s1 serves another TP: not a seed. The agent waits seed_wait_s for nothing, then loads from disk."""
    async with (
        gateway(**PEER) as gw,
        agents(gw, tmp_path, "s0", seed_wait_s=0.3) as sc,
        agents(gw, tmp_path, "s1", tp=2),
        aiohttp.ClientSession() as http,
    ):
        assert gw.monitor.workers["s1"].tp == 2 and gw.monitor.workers["s0"].tp == 1
        first = gw.monitor.workers["s0"].incarnation
        await kill(http, sc["s0"])
        back = await state_event(gw, to("s0", WorkerState.HEALTHY, newer_than=first), within=20)
        choice = gw.reload.choices[-1]
        assert (choice.worker, choice.seed) == ("s0", None)
        await sc["s0"].wait_event(lambda e: e["event"] == "no_seed", 1)
        assert [s["load_format"] for s in starts(tmp_path, "s0")] == ["auto", "auto"]
        assert "reloaded from storage (disk) in" in back.reason and "failed" not in back.reason
        rec = gw.monitor.workers["s0"]
        print(f"\nno seed: agent's reload {rec.reload_seconds:.3f} s (disk, simulated load 0.6 s)")


async def test_a_reload_is_reported_once_per_gateway(tmp_path: Path) -> None:
    """The reload rides on the first SERVING heartbeat after it, and on no later one."""
    async with gateway(**PEER) as gw:
        seen: list[pb.Heartbeat] = []
        gw.control.heartbeat_hooks.append(lambda r, hb: seen.append(hb) if hb.reload_source else None)
        async with agents(gw, tmp_path, "s0", seed_wait_s=0.1) as sc, aiohttp.ClientSession() as http:
            first = gw.monitor.workers["s0"].incarnation
            await kill(http, sc["s0"])
            await state_event(gw, to("s0", WorkerState.HEALTHY, newer_than=first), within=20)
            await heartbeat(gw, lambda r, hb: r.incarnation > first and hb.seq >= 10)
        assert len(seen) == 1 and seen[0].phase == pb.SERVING and seen[0].reload_source == "disk"


async def test_with_engine_reload_disk_the_gateway_names_no_seed(tmp_path: Path) -> None:
    """The default configuration: the agent asks, the gateway names no seed, storage is used."""
    async with (
        gateway() as gw,
        agents(gw, tmp_path, "s0", "s1", seed_wait_s=0.3) as sc,
        aiohttp.ClientSession() as http,
    ):
        first = gw.monitor.workers["s0"].incarnation
        await kill(http, sc["s0"])
        back = await state_event(gw, to("s0", WorkerState.HEALTHY, newer_than=first), within=20)
        choice = gw.reload.choices[-1]
        assert (choice.worker, choice.seed, choice.off) == ("s0", None, True)
        assert [s["load_format"] for s in starts(tmp_path, "s0")] == ["auto", "auto"]
        assert "reloaded from storage (disk)" in back.reason
        assert gw.reload.seeding == {}
