"""θ and τ changed live on a `lumen cluster up` gateway with `lumen cluster config set` (issue 30 item 1),
then a busy worker killed: every interrupted request's dispatch decision (Algorithm 2, made after the
change) names the new τ, and every stream is exact."""

from __future__ import annotations

import asyncio
import re
import sys

from tests.e2e.conftest import admin, assert_exact, kill_busiest, make_requests, run_requests, wait_for
from tests.e2e.test_checkpoint_recovery import LUMEN, streamed


async def test_dispatch_after_a_live_change_uses_the_new_tau(cluster_factory) -> None:  # type: ignore[no-untyped-def]
    c = cluster_factory(workers=3, mode="lumen", **LUMEN)
    before = await admin(c.url, "GET", "/admin/config")
    assert before["values"]["recovery.tau"] == 512
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "cluster", "config", "set",
        "recovery.tau=7", "recovery.theta=2.5", "--port", str(c.port),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    assert proc.returncode == 0, out.decode() + err.decode()
    assert f"gateway :{c.port}  generation 2" in out.decode()
    reqs = make_requests(30, seed=5, min_out=150, max_out=250)
    load = asyncio.create_task(run_requests(c.url, reqs))
    await wait_for(c.url, lambda ws: streamed(ws, pages_per_request=2), 20, "checkpoints to build up")
    killed = await kill_busiest(c.url, "kill", min_running=4)
    assert_exact(await load)
    inter = [
        i
        for i in (await admin(c.url, "GET", "/admin/sessions"))["interrupted"]
        if i["worker"] == killed["worker"]
    ]
    reasons = [i["dispatch_reason"] for i in inter if i.get("dispatch_reason")]
    assert reasons, inter
    # "|C_r|=N > tau=7" (resumed on its holder) or "... and |C_r|=N <= tau=7" (replayed); never 512
    assert all(re.search(r"tau=7\b", r) or "no live holder" in r or "no survivor" in r for r in reasons), (
        reasons
    )
    assert any("tau=7" in r for r in reasons), reasons
    print(f"\n{len(reasons)} decisions after the live change: {sorted(set(reasons))[:4]}")
