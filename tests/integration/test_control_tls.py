"""The control plane over TLS: a worker that trusts the gateway's certificate attaches; a plaintext
client gets no answer from the TLS port; a TLS client with the wrong token is refused. The certificate
is a throwaway self-signed one (openssl), for 127.0.0.1."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from gateway.config import load_config
from gateway.protocol import control_pb2 as pb
from gateway.protocol import control_pb2_grpc as pb_grpc
from gateway.protocol.launch import EngineSpec
from gateway.protocol.versions import CONTROL_PROTOCOL_VERSION
from gateway.server.app import Gateway
from worker_hooks.engine.service import start_worker

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def self_signed(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


async def first_answer(channel: grpc.aio.Channel, token: str) -> pb.GatewayMessage:
    call = pb_grpc.ControlStub(channel).Attach()  # type: ignore[no-untyped-call]
    hello = pb.Hello(
        protocol_version=CONTROL_PROTOCOL_VERSION, worker_id="evil", incarnation=1, http_url="http://x",
        auth_token=token,
    )  # fmt: skip
    await call.write(pb.WorkerMessage(hello=hello))
    answer = await asyncio.wait_for(call.read(), 10)
    call.cancel()
    return answer


async def test_tls_control_plane(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    cfg = load_config(
        overrides={
            "gateway.port": 0,
            "gateway.control_port": 0,
            "timeouts.control_stop_grace_s": 0.05,  # stop() cancels the workers' streams at once
            "gateway.control_tls_cert": str(cert),
            "gateway.control_tls_key": str(key),
            "gateway.control_token_file": str(tmp_path / "token"),
        }
    )
    gw = Gateway(cfg)
    await gw.start()
    address = f"127.0.0.1:{gw.control_port}"
    try:
        spec = EngineSpec(
            worker_id="w0",
            control_address=address,
            control_token=gw.config.gateway.control_token,
            control_tls_ca=str(cert),
            time_scale=0.2,
            heartbeat_interval_ms=50,
        )
        async with start_worker(spec) as w:
            assert w.agent is not None
            await asyncio.wait_for(w.agent.attached.wait(), 20)
            assert gw.monitor.workers["w0"].state.value == "HEALTHY"
        # plaintext against the TLS port: no answer at all
        async with grpc.aio.insecure_channel(address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await first_answer(channel, gw.config.gateway.control_token)
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        # TLS with a wrong token: refused, nothing recorded
        creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        async with grpc.aio.secure_channel(address, creds) as channel:
            answer = await first_answer(channel, "not-the-token-at-all")
            assert answer.WhichOneof("body") == "refuse"
        assert "evil" not in gw.monitor.workers
        assert (tmp_path / "token").stat().st_mode & 0o077 == 0  # the generated token, published 0600
    finally:
        await gw.stop()
    assert not (tmp_path / "token").exists()
