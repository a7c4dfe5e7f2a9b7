"""The agent's reloader never seeds a server SGLang's remote_instance loader cannot load: only CUDA and
NPU devices (srt/connector/remote_instance.py). Seen on real SGLang with --device cpu: the seeded
relaunch failed in its loader after asking the seed to set up the transfer group, and the seed hung."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from worker_hooks.sglang.agent_config import SidecarConfig
from worker_hooks.sglang.agent_reload import Reloader, seed_refusal
from worker_hooks.sglang.launcher import ServerExit

DISK = ["python", "-m", "sglang.launch_server", "--model-path", "m", "--port", "30000"]


def reloader(launch: list[str], events: list[dict[str, Any]]) -> Reloader:
    cfg = SidecarConfig(
        worker_id="w", url="http://127.0.0.1:30000", gateways=("127.0.0.1:1",), seed_wait_s=5.0
    )
    return Reloader(
        cfg, launch, seeding=True, emit=lambda e, **f: events.append({"event": e, **f}), kill=lambda: None
    )


@pytest.mark.parametrize(
    ("args", "refused"),
    [
        ([], False),  # SGLang's default device: cuda
        (["--device", "cuda"], False),
        (["--device", "npu"], False),
        (["--device", "cpu"], True),
        (["--device", "xpu"], True),
    ],
)
def test_only_cuda_and_npu_servers_are_seeded(args: list[str], refused: bool) -> None:
    assert bool(seed_refusal([*DISK, *args])) is refused
    r = reloader([*DISK, *args], [])
    assert r.seeding is not refused


async def test_a_cpu_server_waits_for_no_seed_and_ignores_one() -> None:
    events: list[dict[str, Any]] = []
    launch = [*DISK, "--device", "cpu"]
    r = reloader(launch, events)
    assert "remote_instance" in r.seed_refused
    r.started(1)
    r.ready()
    r.exited(ServerExit(pid=1, returncode=-9, at=time.monotonic(), uptime_s=10.0))
    assert not r.awaiting_seed  # its Hello and heartbeats ask the gateway for nothing
    r.offer_seed("s1", "http://10.0.0.2:30000")  # a gateway's ReloadFrom anyway: ignored
    t0 = time.monotonic()
    command = await asyncio.wait_for(r.next_command(), 1.0)
    assert command == launch and time.monotonic() - t0 < 1.0  # at once, not after seed_wait_s (5 s)
    assert not r.attempt.seed
    assert [e["event"] for e in events] == ["server_started"]
    r.started(2)
    r.ready()
    assert r.reload is not None and r.reload.source.value == "disk"


async def test_a_gpu_server_still_waits_for_its_seed() -> None:
    events: list[dict[str, Any]] = []
    r = reloader(list(DISK), events)
    r.started(1)
    r.ready()
    r.exited(ServerExit(pid=1, returncode=-9, at=time.monotonic(), uptime_s=10.0))
    assert r.awaiting_seed
    r.offer_seed("s1", "http://10.0.0.2:30000")
    command = await asyncio.wait_for(r.next_command(), 1.0)
    assert "remote_instance" in command and r.attempt.seed == "s1"
