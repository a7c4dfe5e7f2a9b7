"""Issue 29, finding 4: another local user (uid 65534, a real process started with `setpriv`) squats the
SGLang holder-status socket before the holder binds it, to answer the agent's polls with an invented
status (1 TiB used, a request it never held). The holder and its agent run as a third user (uid 4242,
as a server's user would), also a real process. The socket now lives in that user's 0700 runtime
directory, so the squatter cannot bind it; a holder that cannot bind its status socket fails (it used
to warn and go on), and the agent only reads a status socket its own user serves (SO_PEERCRED)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from worker_hooks.sglang.storage_layout import status_endpoint_for

NOBODY = 65534
SERVER_USER = 4242
REPO = Path(__file__).resolve().parents[2]
FAKE_BYTES = 1 << 40

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv (other uids)"
)

SQUATTER = f"""
import os, sys, zmq
from gateway.protocol import holder_status as hs
sock = zmq.Context().socket(zmq.REP)
try:
    sock.bind(sys.argv[1])
except zmq.ZMQError as exc:
    print("denied", exc, flush=True)
    sys.exit(0)
os.chmod(sys.argv[1].removeprefix("ipc://"), 0o777)  # anyone may connect to the squatter
print("bound", flush=True)
while True:
    sock.recv()
    sock.send(hs.encode(hs.HolderStatus(bytes_used={FAKE_BYTES}, durable={{"invented": 4096}})))
"""

HOLDER_AND_AGENT = """
import asyncio, json, sys
from gateway.protocol.planes import MemberTable, PlaneAuth
from worker_hooks.sglang.holder_report import HolderPoller
from worker_hooks.sglang.page_store import PageStore
from worker_hooks.sglang.page_store_config import PageStoreConfig
endpoint = sys.argv[1]
try:
    holder = PageStore(
        PageStoreConfig(worker_id="h", holder_bind="tcp://127.0.0.1:0", status_bind=endpoint, budget_bytes=1 << 20),
        auth=PlaneAuth.generate(MemberTable()),
    )
except Exception as exc:
    print(json.dumps({"failed": repr(exc)}), flush=True)
    sys.exit(3)
poller = HolderPoller([endpoint], timeout_s=5.0)
report = asyncio.run(poller.poll())
poller.close()
holder.close()
print(json.dumps({"report": None if report is None else [report.bytes_used, report.durable]}), flush=True)
"""


def as_user(uid: int, *argv: str, env: dict[str, str]) -> list[str]:
    return ["setpriv", "--reuid", str(uid), "--regid", str(uid), "--clear-groups", *argv]


def test_another_user_cannot_squat_the_holder_status_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = Path(tempfile.mkdtemp(prefix="lumen-run-4242-"))  # the server user's XDG_RUNTIME_DIR
    os.chown(runtime, SERVER_USER, SERVER_USER)
    runtime.chmod(0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    endpoint = status_endpoint_for("tcp://127.0.0.1:5999")  # as the server and its agent derive it
    env = {**os.environ, "PYTHONPATH": str(REPO), "XDG_RUNTIME_DIR": str(runtime), "HOME": str(runtime)}
    squatter = subprocess.Popen(
        as_user(NOBODY, sys.executable, "-B", "-c", SQUATTER, endpoint, env=env),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env,
    )  # fmt: skip
    try:
        assert squatter.stdout is not None
        said = squatter.stdout.readline().strip()
        assert said, squatter.stderr.read() if squatter.stderr else ""
        victim = subprocess.run(
            as_user(SERVER_USER, sys.executable, "-B", "-c", HOLDER_AND_AGENT, endpoint, env=env),
            capture_output=True, text=True, cwd=REPO, env=env, timeout=60, check=False,
        )  # fmt: skip
        lines = [ln for ln in victim.stdout.splitlines() if ln.startswith("{")]
        assert lines, victim.stderr[-3000:]
        out = json.loads(lines[-1])
        if "failed" in out:  # a squatted socket is an error the server stops on, never a warning
            assert said.startswith("bound"), f"the holder failed with no squatter: {out}"
            return
        assert out["report"] is not None, "the agent could not read its own holder's status"
        bytes_used, durable = out["report"]
        assert bytes_used != FAKE_BYTES and "invented" not in durable, (
            f"the agent read another user's invented holder status (squatter: {said})"
        )
        assert bytes_used == 0 and said.startswith("denied")
    finally:
        squatter.kill()
        squatter.communicate()
        shutil.rmtree(runtime, ignore_errors=True)
