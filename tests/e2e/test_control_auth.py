"""The attacks of issue 15 on the control plane and the workers' HTTP, against a real `lumen cluster up`
with the default config (no secret set): a fake worker, a forged incarnation of a real worker, and
unauthenticated requests to a worker's HTTP API. None gets in; the secret the gateway generated is in a
0600 file and nowhere else a local user or a scraper can read (argv, logs, /metrics)."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from gateway.protocol import control_pb2 as pb
from gateway.protocol import control_pb2_grpc as pb_grpc
from gateway.protocol.secrets import admin_headers, default_token_path, read_token_file, worker_http_bearer
from gateway.protocol.versions import CONTROL_PROTOCOL_VERSION
from loadtests.cluster_proc import ClusterProcess

FORGED_INCARNATION = 2**63 - 1


async def attach_once(address: str, hello: pb.Hello) -> pb.GatewayMessage:
    """What a grpcio script gets back for one Hello: the gateway's first answer."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.ControlStub(channel)  # type: ignore[no-untyped-call]
        call = stub.Attach()
        await call.write(pb.WorkerMessage(hello=hello))
        answer = await asyncio.wait_for(call.read(), 10)
        call.cancel()
        assert answer is not grpc.aio.EOF
        return answer


async def workers(url: str) -> list[dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(url + "/admin/workers", headers=admin_headers(url)) as resp,
    ):
        assert resp.status == 200
        return list(await resp.json())


def evil_hello(worker_id: str, incarnation: int, token: str = "") -> pb.Hello:
    return pb.Hello(
        protocol_version=CONTROL_PROTOCOL_VERSION,
        worker_id=worker_id,
        incarnation=incarnation,
        http_url="http://127.0.0.1:9",  # where a fake worker would read prompts and forge text
        auth_token=token,
        phase=pb.SERVING,
    )


@pytest.fixture
def cluster(tmp_path: Path) -> Any:
    # no LUMEN_CONTROL_TOKEN: the gateway must generate one; fault injection off as in production
    env = {k: v for k, v in os.environ.items() if not k.startswith("LUMEN_")}
    # (a stopping gateway cancels the workers' control streams after 0.05 s, not 0.5 s: the teardown)
    overrides = {"cluster.fault_injection": False, "timeouts.control_stop_grace_s": 0.05}
    with ClusterProcess(workers=2, log_dir=tmp_path, env=env, overrides=overrides) as c:
        yield c


def test_no_fake_worker_no_forged_incarnation_no_unauthenticated_worker_http(cluster: ClusterProcess) -> None:
    c = cluster
    address = f"127.0.0.1:{c.ready['control_port']}"
    token_file = default_token_path(c.ready["control_port"])
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = read_token_file(token_file)

    async def scenario() -> None:
        before = await workers(c.url)
        w0 = next(w for w in before if w["id"] == "w0")
        # a fake worker with its own http_url, no token / a guessed one: refused, nothing recorded
        for guess in ("", "x" * 43):
            answer = await attach_once(address, evil_hello("evil2", 1, guess))
            assert answer.WhichOneof("body") == "refuse" and "token" in answer.refuse.reason
        # a real worker's id with the highest incarnation: refused, the real one untouched
        answer = await attach_once(address, evil_hello("w0", FORGED_INCARNATION))
        assert answer.WhichOneof("body") == "refuse"
        after = await workers(c.url)
        assert {w["id"] for w in after} == {w["id"] for w in before}
        w0_after = next(w for w in after if w["id"] == "w0")
        assert (w0_after["state"], w0_after["incarnation"]) == ("HEALTHY", w0["incarnation"])

        # the worker's HTTP: nothing without the cluster's bearer; no fault route on a production worker
        body = {"input_ids": [72, 105], "sampling_params": {"max_new_tokens": 4}, "stream": False}
        good = {"Authorization": f"Bearer {worker_http_bearer(token)}"}
        async with aiohttp.ClientSession() as http:
            for headers in ({}, {"Authorization": f"Bearer {token}"}, {"Authorization": "Bearer nope"}):
                for path, payload in (
                    ("/generate", body),
                    ("/abort_request", {"rid": "x"}),
                    ("/lumen/fault", {"slowdown": 100}),
                    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                ):
                    async with http.post(w0["url"] + path, json=payload, headers=headers) as resp:
                        assert resp.status == 401, (path, headers)
                        assert (await resp.json())["error"]["type"] == "authentication_error"
            async with http.post(w0["url"] + "/generate", json=body, headers=good) as resp:
                assert resp.status == 200, await resp.text()
                assert len((await resp.json())["output_ids"]) == 4
            async with http.post(w0["url"] + "/lumen/fault", json={"slowdown": 2}, headers=good) as resp:
                assert resp.status == 404
            async with http.get(w0["url"] + "/health") as resp:
                assert resp.status == 200  # liveness needs no secret
            # the client API works as before through the gateway (it holds the bearer)
            completion = {"prompt": "Hello", "max_tokens": 8, "temperature": 0}
            async with http.post(c.url + "/v1/completions", json=completion) as resp:
                assert resp.status == 200, await resp.text()
            async with http.get(c.url + "/metrics") as resp:
                metrics = await resp.text()
        assert token not in metrics and worker_http_bearer(token) not in metrics

    asyncio.run(scenario())
    pids = [c.proc.pid] if c.proc is not None else []
    pids += [int(w["pid"]) for w in asyncio.run(workers(c.url))]
    for pid in pids:
        assert token.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    c.stop()
    logs = [p for p in Path(c.stderr_path).parent.rglob("*") if p.is_file()]
    assert logs and all(token not in p.read_text(errors="replace") for p in logs)
    assert not token_file.exists()  # removed when the gateway stops
