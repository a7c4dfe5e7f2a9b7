"""A seed is never left hung (sglang 0.5.23 on CPU, a tiny float32 Qwen3, Lumen's plugin loaded).

A restarting server with `--load-format remote_instance` first asks its seed's
`/init_weights_send_group_for_remote_instance`; the seed's scheduler then waits in the transfer group's
rendezvous for the restarting server to join. Seen on this machine (a restarting server on CPU, whose
loader refuses remote_instance after asking): the seed gave no answer to `/generate` in 15 s, twice,
while `/ready` answered 200 — for torch's default 30 minutes.

Here the test asks the seed exactly as SGLang's loader does (`trigger_init_weights_send_group_for_remote_
instance_request`'s body) and nobody joins. The seed runs as Lumen's agent launches it (a plane file):
the plugin's time box (`seed_group_timeout_s`, plugin_seed.py) ends the wait, and meanwhile the
gateway's generation probe (gateway/server/recovery/reload.py) sees that the seed stopped generating
where `/ready` says nothing.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.protocol.plane_file import PLANE_FILE_ENV, PlaneFile, write_plane_file
from gateway.protocol.planes import CurveKeypair
from loadtests.cluster_proc import free_port
from tests.sglang.real import SGLangServer, tiny_models

pytestmark = pytest.mark.timeout(600)

BOX_S = 20.0  # the plugin's time box on the transfer group's set-up, for this server


@pytest.fixture(scope="module")
def seed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SGLangServer]:
    folder = tmp_path_factory.mktemp("plane") / "private"
    folder.mkdir(mode=0o700)
    plane = folder / "seed.json"
    write_plane_file(plane, PlaneFile({"seed": CurveKeypair.generate()}, [], []))
    logs = tmp_path_factory.mktemp("sglang-reload-logs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(PLANE_FILE_ENV, str(plane))
        mp.setenv("SGLANG_PLUGINS", "lumen")
        mp.setenv("LUMEN_SGLANG_PLUGIN", json.dumps({"seed_group_timeout_s": BOX_S}))
        s = SGLangServer(tiny_models()["target"], logs / "sglang-seed.log")
    try:
        yield s.wait_ready()
    finally:
        s.stop()


def post(url: str, body: dict[str, Any], timeout_s: float) -> tuple[int, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def ready(url: str) -> int:
    with urllib.request.urlopen(f"{url}/ready", timeout=5) as resp:
        return int(resp.status)


def one_token(url: str, timeout_s: float) -> bool:
    try:
        post(f"{url}/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}, timeout_s)
    except (TimeoutError, urllib.error.URLError):
        return False
    return True


async def gateway_probe(url: str, timeout_s: float) -> bool:
    """The gateway's own generation probe of a seed (ReloadCoordinator._generate_probe)."""
    from gateway.core.types import LoadParams
    from gateway.server.metrics import GatewayMetrics
    from gateway.server.recovery.reload import ReloadCoordinator
    from gateway.server.workers.control import ControlService
    from gateway.server.workers.monitor import LoadMonitor

    monitor = LoadMonitor(clock=time.monotonic, heartbeat_interval_s=0.05, heartbeat_misses=3)
    async with aiohttp.ClientSession() as http:
        coord = ReloadCoordinator(
            monitor=monitor,
            control=ControlService(monitor, token="", heartbeat_interval_ms=50),
            load_params=LoadParams(alpha=1.0, beta=1.0, nominal_batch=8),
            metrics=GatewayMetrics(),
            http=lambda: http,
        )
        rec: Any = type("Rec", (), {"http_url": url})()
        return await coord._generate_probe(rec, timeout_s)


def test_a_seed_whose_restart_never_joins_is_seen_stopped_and_serves_again_after_the_time_box(
    seed: SGLangServer,
) -> None:
    assert one_token(seed.url, 60)
    port = free_port(1)  # the group port: nobody joins there
    answer: dict[str, Any] = {}

    def ask() -> None:  # what the restarting server's loader sends (remote_instance_weight_loader_utils)
        t0 = time.monotonic()
        answer["reply"] = post(
            f"{seed.url}/init_weights_send_group_for_remote_instance",
            {
                "master_address": "127.0.0.1",
                "ports": str(port),
                "group_rank": 0,
                "world_size": 2,
                "group_name": "send_weights_127.0.0.1",
                "backend": "nccl",
            },
            600,
        )
        answer["s"] = time.monotonic() - t0

    asker = threading.Thread(target=ask, daemon=True)
    t0 = time.monotonic()
    asker.start()
    time.sleep(1.0)
    # the seed stopped generating, and /ready does not say so; the gateway's probe does
    assert ready(seed.url) == 200
    assert not asyncio.run(gateway_probe(seed.url, 3.0))
    assert ready(seed.url) == 200
    # the time box ends the wait: the seed answers the restart (a failure) and generates again
    asker.join(BOX_S + 60)
    assert not asker.is_alive(), "the transfer group's set-up was not time-boxed"
    status, reply = answer["reply"]
    assert status == 400 and reply["success"] is False, reply
    assert BOX_S - 1 <= answer["s"] <= BOX_S + 30, answer["s"]
    assert one_token(seed.url, 30)
    assert asyncio.run(gateway_probe(seed.url, 10.0))
    back = time.monotonic() - t0
    log = Path(seed.log_path).read_text(errors="replace")
    assert "lumen_seed_group_time_boxed" in log
    print(
        f"\nseed hung {answer['s']:.1f} s in the transfer group's set-up (box {BOX_S:g} s), "
        f"generating again {back:.1f} s after the request; /ready 200 throughout"
    )
