"""A hung worker comes back by itself: the detector fails it by silence (its probe unanswered), and the
local supervisor kills it after `cluster.hung_restart_grace_s` and restarts it as a new incarnation."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import admin, wait_for


async def test_a_hung_worker_is_killed_and_restarted_without_manual_action(cluster_factory) -> None:
    # the restarted process pays the modelled load time before it serves: short here (nothing here is
    # about load times)
    c = cluster_factory(
        workers=3, mode="stop_restart", **{"cluster.hung_restart_grace_s": 1.0, "engine.model_load_s": 0.3}
    )
    victim = (await admin(c.url, "GET", "/admin/workers"))[0]
    wid = victim["id"]
    await admin(c.url, "POST", f"/admin/workers/{wid}/kill?mode=hang")  # SIGSTOP: alive and silent
    await wait_for(c.url, lambda ws: any(w["id"] == wid and w["state"] == "FAILED" for w in ws), 10, "FAILED")
    ws = await wait_for(
        c.url,
        lambda ws: any(
            w["id"] == wid and w["state"] == "HEALTHY" and w["incarnation"] > victim["incarnation"]
            for w in ws
        ),
        60,
        "the hung worker to come back as a new incarnation",
    )
    back = next(w for w in ws if w["id"] == wid)
    assert back["pid"] != victim["pid"]  # a new process: the stopped one was killed
    events = [e for e in await admin(c.url, "GET", "/admin/events") if e["worker"] == wid]
    failed = next(e for e in events if e["to"] == "FAILED")
    assert failed["incarnation"] == victim["incarnation"]
    assert "no answer to a probe" in failed["reason"], failed
    # nobody else was touched
    assert all(w["state"] == "HEALTHY" for w in ws if w["id"] != wid)
    assert not any(
        e["to"] == "FAILED" for e in await admin(c.url, "GET", "/admin/events") if e["worker"] != wid
    )


@pytest.mark.slow  # in-process: tests/integration/test_hung_supervisor.py
async def test_a_hung_worker_resumed_within_the_grace_is_not_killed(cluster_factory) -> None:
    """The zombie wakes before the grace is over: it resets and re-attaches in the same process."""
    c = cluster_factory(workers=2, mode="stop_restart", **{"cluster.hung_restart_grace_s": 30.0})
    victim = (await admin(c.url, "GET", "/admin/workers"))[0]
    wid = victim["id"]
    await admin(c.url, "POST", f"/admin/workers/{wid}/kill?mode=hang")
    await wait_for(c.url, lambda ws: any(w["id"] == wid and w["state"] == "FAILED" for w in ws), 10, "FAILED")
    await admin(c.url, "POST", f"/admin/workers/{wid}/kill?mode=resume")
    ws = await wait_for(
        c.url,
        lambda ws: any(
            w["id"] == wid and w["state"] == "HEALTHY" and w["incarnation"] > victim["incarnation"]
            for w in ws
        ),
        30,
        "the resumed worker to re-attach",
    )
    assert next(w for w in ws if w["id"] == wid)["pid"] == victim["pid"]  # the same process
