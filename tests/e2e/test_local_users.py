"""Issue 29, "trust nothing, round two": another user on the same host (uid 65534, by `setpriv`) and a
worker that holds the control token, against a real `lumen cluster up` with the default config.

1. /admin is closed by default: the gateway generates an admin key (0600 file in the per-user runtime
   directory, never on argv), any request without it is 401 from any address, `lumen cluster status`
   finds it, and signal-sending faults exist only with `cluster.fault_injection`.
2. The gateway signals only processes its supervisor launched: a worker that reports the pid of an
   unrelated process does not get that process killed.
3. Refusals before authentication are logged truncated and rate-limited: ten 3 MB worker ids do not
   put megabytes in the gateway's log.
5. A token file owned by another user is refused, even with mode 0600.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import zmq

from gateway.protocol import control_pb2 as pb
from gateway.protocol import control_pb2_grpc as pb_grpc
from gateway.protocol.secrets import default_token_path, read_token_file
from gateway.protocol.versions import CONTROL_PROTOCOL_VERSION
from loadtests.cluster_proc import ClusterProcess

NOBODY = 65534
REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv (another uid)"
)


def as_nobody(*argv: str, timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
    """`argv` run as uid/gid 65534 with no supplementary groups: another local user."""
    cmd = ["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY), "--clear-groups", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)


def curl_status(method: str, url: str) -> str:
    """The HTTP status another user gets for `method url` (curl, no credentials)."""
    out = as_nobody("curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", method, url)
    return out.stdout.strip()


def admin_headers(url: str) -> dict[str, str]:
    """What the owner's tools present to /admin (the generated key from the runtime directory)."""
    try:
        from gateway.protocol.secrets import admin_headers as headers
    except ImportError:  # before issue 29: admin was open on loopback
        return {}
    return headers(url)


async def admin(url: str, method: str, path: str, expect: int = 200) -> Any:
    async with (
        aiohttp.ClientSession() as http,
        http.request(method, url + path, headers=admin_headers(url)) as r,
    ):
        assert r.status == expect, await r.text()
        return await r.json()


def production_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("LUMEN_")}


def test_admin_is_closed_to_other_users_and_signal_faults_need_fault_injection(tmp_path: Path) -> None:
    env = {**production_env(), "LUMEN_API_KEYS": "client-key-0123456789"}
    overrides = {"cluster.fault_injection": False, "timeouts.control_stop_grace_s": 0.05}
    with ClusterProcess(workers=2, log_dir=tmp_path, env=env, overrides=overrides) as c:
        # another local user: 401 on every admin route, the workers untouched
        assert curl_status("POST", c.url + "/admin/workers/w0/kill?mode=kill") == "401"
        assert curl_status("POST", c.url + "/admin/workers/w1/kill?mode=hang") == "401"
        assert curl_status("GET", c.url + "/admin/workers") == "401"
        from gateway.protocol.secrets import default_admin_key_path

        key_file = default_admin_key_path(c.port)
        assert key_file.stat().st_mode & 0o777 == 0o600 and key_file.stat().st_uid == os.geteuid()
        key = key_file.read_text().strip()
        assert len(key) >= 32
        # never on a command line
        for pid in [c.proc.pid if c.proc else 0, *c.ready.get("gateway_pids", [])]:
            if pid:
                assert key.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        # the owner's `lumen cluster status` finds the key by itself
        status = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "cluster", "status", "--port", str(c.port)],
            capture_output=True, text=True, timeout=30, check=False, env=production_env(), cwd=REPO,
        )  # fmt: skip
        assert status.returncode == 0, status.stderr
        assert "w0" in status.stdout and "HEALTHY" in status.stdout

        async def owner() -> None:
            ws = await admin(c.url, "GET", "/admin/workers")
            assert {w["state"] for w in ws} == {"HEALTHY"} and len(ws) == 2
            # a wrong key is 401 as well
            async with (
                aiohttp.ClientSession() as http,
                http.get(c.url + "/admin/workers", headers={"Authorization": "Bearer " + "x" * 43}) as r,
            ):
                assert r.status == 401
            # signal faults need a cluster started with cluster.fault_injection, even with the key
            for mode in ("kill", "hang", "stall"):
                body = await admin(c.url, "POST", f"/admin/workers/w0/kill?mode={mode}", expect=400)
                assert "fault_injection" in body["error"]["message"]
            ws = await admin(c.url, "GET", "/admin/workers")
            assert {w["state"] for w in ws} == {"HEALTHY"}

        asyncio.run(owner())
        c.stop()
        assert not key_file.exists()  # removed when the cluster stops


async def attach_holding(address: str, hello: pb.Hello, while_attached: Any) -> Any:
    """Attach with `hello`, run `while_attached()` while the control stream is open, detach."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.ControlStub(channel)  # type: ignore[no-untyped-call]
        call = stub.Attach()
        await call.write(pb.WorkerMessage(hello=hello))
        answer = await asyncio.wait_for(call.read(), 10)
        assert answer is not grpc.aio.EOF and answer.WhichOneof("body") == "welcome", answer
        try:
            return await while_attached()
        finally:
            call.cancel()


def test_a_worker_cannot_get_an_unrelated_process_signalled(tmp_path: Path) -> None:
    victim = subprocess.Popen(["sleep", "600"])
    try:
        with ClusterProcess(workers=1, log_dir=tmp_path, env=production_env(), overrides={}) as c:
            token = read_token_file(default_token_path(c.ready["control_port"]))
            public, _ = zmq.curve_keypair()
            hello = pb.Hello(
                protocol_version=CONTROL_PROTOCOL_VERSION,
                worker_id="liar",
                incarnation=1,
                http_url="http://127.0.0.1:9",
                auth_token=token,
                plane_key=public.decode(),
                pid=victim.pid,  # not a process the supervisor started
                phase=pb.SERVING,
            )

            async def kill_it() -> tuple[int, str]:
                async with aiohttp.ClientSession() as http:
                    url = c.url + "/admin/workers/liar/kill?mode=kill"
                    async with http.post(url, headers=admin_headers(c.url)) as r:
                        return r.status, await r.text()

            status, text = asyncio.run(attach_holding(f"127.0.0.1:{c.ready['control_port']}", hello, kill_it))
            assert victim.poll() is None, "the gateway killed a process its supervisor never started"
            assert status in (400, 403, 404, 409), text
            # a real worker is still killed (and restarted) as before
            w0 = asyncio.run(admin(c.url, "GET", "/admin/workers"))
            real = next(w for w in w0 if w["id"] == "w0")
            asyncio.run(admin(c.url, "POST", "/admin/workers/w0/kill?mode=kill"))
            assert subprocess.run(["kill", "-0", str(real["pid"])], check=False).returncode != 0 or (
                Path(f"/proc/{real['pid']}/stat").read_text().split()[2] == "Z"
            )
    finally:
        victim.kill()
        victim.wait()


def test_refusals_before_authentication_do_not_flood_the_log(tmp_path: Path) -> None:
    overrides = {"timeouts.control_stop_grace_s": 0.05}
    with ClusterProcess(workers=1, log_dir=tmp_path, env=production_env(), overrides=overrides) as c:
        log_file = tmp_path / "gateway-0.log"
        before = log_file.stat().st_size
        huge = "A" * (3 << 20)

        async def flood() -> None:
            async with grpc.aio.insecure_channel(
                f"127.0.0.1:{c.ready['control_port']}",
                options=[("grpc.max_send_message_length", 8 << 20)],
            ) as channel:
                stub = pb_grpc.ControlStub(channel)  # type: ignore[no-untyped-call]
                for i in range(10):
                    call = stub.Attach()
                    hello = pb.Hello(
                        protocol_version=CONTROL_PROTOCOL_VERSION,
                        worker_id=huge,
                        incarnation=i,
                        http_url="http://127.0.0.1:9",
                        auth_token="wrong",
                        phase=pb.SERVING,
                    )
                    await call.write(pb.WorkerMessage(hello=hello))
                    answer = await asyncio.wait_for(call.read(), 10)
                    assert answer is not grpc.aio.EOF and answer.WhichOneof("body") == "refuse"
                    assert len(answer.refuse.reason) < 4096
                    call.cancel()

        asyncio.run(flood())
        c.stop()  # the log is complete once the gateway has exited
        grown = log_file.stat().st_size - before
        text = log_file.read_text(errors="replace")
        assert grown < 64 << 10, f"the gateway log grew by {grown} bytes for ten refused attaches"
        assert "attach_refused" in text


def test_a_token_file_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    token_file = tmp_path / "control-token"
    token_file.write_text("planted-by-another-user-0123456789abcdef")
    token_file.chmod(0o600)
    os.chown(token_file, NOBODY, NOBODY)  # mode 0600, but not ours
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "gateway.cli", "gateway", "--port", "0", "--control-port", "0",
            "--set", f'gateway.control_token_file="{token_file}"',
        ],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
        env=production_env(), cwd=REPO,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"the gateway started with another user's token file: {out}")
    assert '"ready"' not in out, "the gateway started with another user's token file"
    assert proc.returncode != 0
    assert "owned by" in err and str(token_file) in err
