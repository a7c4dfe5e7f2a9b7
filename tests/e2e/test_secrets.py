"""Secrets stay out of what other users on the host can read (issue 15, in part): with a control token,
client keys and admin keys set, no worker's command line holds any of them (the launch spec travels
in the environment, readable only by the same user and root), and no worker inherits the client or
admin keys."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from loadtests.cluster_proc import ClusterProcess

CONTROL = "control-token-secret-1234"
CLIENT = "client-key-secret-5678"
ADMIN = "admin-key-secret-9012"


def test_worker_processes_hold_no_secret_in_argv_and_no_gateway_keys(tmp_path: Path) -> None:
    env = {"LUMEN_CONTROL_TOKEN": CONTROL, "LUMEN_API_KEYS": CLIENT, "LUMEN_ADMIN_API_KEYS": ADMIN}
    fast_stop = {"timeouts.control_stop_grace_s": 0.05}  # the teardown: streams cancelled at once
    with ClusterProcess(workers=2, log_dir=tmp_path, env=env, overrides=fast_stop) as c:

        async def workers() -> list[dict[str, object]]:
            async with (
                aiohttp.ClientSession() as http,
                http.get(c.url + "/admin/workers", headers={"Authorization": f"Bearer {ADMIN}"}) as resp,
            ):
                assert resp.status == 200
                return list(await resp.json())

        pids = [int(str(w["pid"])) for w in asyncio.run(workers())]
        assert len(pids) == 2 and all(pids)
        for pid in pids:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            assert not any(s.encode() in argv for s in (CONTROL, CLIENT, ADMIN)), argv
            assert CLIENT.encode() not in environ and ADMIN.encode() not in environ
