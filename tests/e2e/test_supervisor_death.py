"""Issue 29, "lifecycles that end": a `lumen cluster up` supervisor killed with SIGKILL takes its
gateways down with it (PR_SET_PDEATHSIG: they used to run on with no workers), and the files it
published (the control token, the generated admin key, the launch registry) do not outlive it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from gateway.protocol.secrets import default_admin_key_path, default_token_path
from loadtests.cluster_proc import ClusterProcess


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_gateway_whose_supervisor_dies_stops_and_the_secret_files_go(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LUMEN_")}
    overrides = {"timeouts.control_stop_grace_s": 0.05}
    with ClusterProcess(workers=1, log_dir=tmp_path, env=env, overrides=overrides) as c:
        assert c.proc is not None
        gateways = [int(p) for p in c.ready["gateway_pids"]]
        files = [default_token_path(c.ready["control_port"]), default_admin_key_path(c.port)]
        assert gateways and all(alive(p) for p in gateways)
        assert all(f.exists() for f in files[:1])
        os.kill(c.proc.pid, signal.SIGKILL)
        c.proc.wait()
        deadline = time.monotonic() + 20
        while any(alive(p) for p in gateways) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(p) for p in gateways), "a gateway runs on after its supervisor died"
        left = [str(f) for f in files if f.exists()]
        assert left == [], f"the dead supervisor's files are left behind: {left}"
