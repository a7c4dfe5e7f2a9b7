"""Replay failover end to end: workers die, hang, or come back as zombies; clients see exact streams."""

from __future__ import annotations

import asyncio

import pytest

from tests.e2e.conftest import (
    admin,
    assert_exact,
    expected_text,
    kill_busiest,
    make_requests,
    run_requests,
    wait_for,
)


async def test_kill_busiest_worker_mid_generation(shared_cluster) -> None:
    c = shared_cluster  # shared with test_cluster.py and the hang below: the victim read by incarnation
    reqs = make_requests(60, seed=11)
    load = asyncio.create_task(run_requests(c.url, reqs))
    killed = await kill_busiest(c.url, "kill", min_running=10)
    old_inc = killed["victim"]["incarnation"]
    results = await load
    assert_exact(results)

    sessions = await admin(c.url, "GET", "/admin/sessions")
    interrupted = [
        i for i in sessions["interrupted"] if i["worker"] == killed["worker"] and i["incarnation"] == old_inc
    ]
    assert len(interrupted) >= 10, "the busiest worker's requests must have been interrupted and resumed"
    assert all(i["resumed_on"] not in (None, killed["worker"]) for i in interrupted)
    events = await admin(c.url, "GET", "/admin/events")
    failed = [
        e
        for e in events
        if e["worker"] == killed["worker"] and e["to"] == "FAILED" and e["incarnation"] == old_inc
    ]
    assert failed and failed[0]["t"] - killed["at"] < 1.0
    # the supervisor restarts it as a new incarnation, which rejoins after its modelled load time
    await wait_for(
        c.url,
        lambda ws: any(
            w["id"] == killed["worker"] and w["state"] == "HEALTHY" and w["incarnation"] > old_inc for w in ws
        ),
        30,
        "the killed worker to rejoin",
    )


async def test_hung_worker_is_fenced_and_its_zombie_tokens_never_reach_clients(shared_cluster) -> None:
    c = shared_cluster
    reqs = make_requests(30, seed=12)
    load = asyncio.create_task(run_requests(c.url, reqs))
    hung = await kill_busiest(c.url, "hang", min_running=5)
    wid = hung["worker"]
    await wait_for(c.url, lambda ws: any(w["id"] == wid and w["state"] == "FAILED" for w in ws), 10, "FAILED")
    await asyncio.sleep(0.3)
    # wake the zombie while the replays are still streaming: it must not leak into any client stream
    await admin(c.url, "POST", f"/admin/workers/{wid}/kill?mode=resume")
    results = await load
    assert_exact(results)
    # the zombie learns it was fenced, resets, and re-attaches as a new incarnation
    await wait_for(
        c.url,
        lambda ws: any(
            w["id"] == wid and w["state"] == "HEALTHY" and w["incarnation"] > hung["victim"]["incarnation"]
            for w in ws
        ),
        20,
        "the zombie to re-attach",
    )


@pytest.mark.slow  # the default run kills once (test_kill_busiest_worker_mid_generation)
async def test_second_failure_during_replay(cluster_factory) -> None:
    c = cluster_factory(workers=3, mode="stop_restart", **{"cluster.restart_killed": False})
    reqs = make_requests(30, seed=13, min_out=120, max_out=200)
    load = asyncio.create_task(run_requests(c.url, reqs))
    first = await kill_busiest(c.url, "kill", min_running=5)
    await asyncio.sleep(0.4)  # replays are now streaming on the survivors
    second = await kill_busiest(c.url, "kill", min_running=1, exclude=(first["worker"],))
    results = await load
    assert_exact(results)
    sessions = await admin(c.url, "GET", "/admin/sessions")
    twice = {i["rid"] for i in sessions["interrupted"] if i["worker"] == second["worker"]} & {
        i["rid"] for i in sessions["interrupted"] if i["worker"] == first["worker"]
    }
    assert twice, "some request should have been interrupted by both failures"


@pytest.mark.slow  # in-process: test_openai_api.py's no_healthy_worker case
async def test_all_workers_dead_gives_a_clear_error_not_a_hang(cluster_factory) -> None:
    c = cluster_factory(
        workers=2, mode="stop_restart", **{"cluster.restart_killed": False, "recovery.no_worker_wait_s": 1.0}
    )
    reqs = make_requests(8, seed=14, min_out=150, max_out=200)
    load = asyncio.create_task(run_requests(c.url, reqs))
    first = await kill_busiest(c.url, "kill", min_running=1)
    await kill_busiest(c.url, "kill", min_running=1, exclude=(first["worker"],))
    results = await asyncio.wait_for(load, 15)
    assert all(not r.ok for r in results), [
        (r.idx, r.ok, r.error, len(r.text), r.max_tokens) for r in results
    ]
    assert all("no healthy worker" in (r.error or "") for r in results), [r.error for r in results]
    async with __import__("aiohttp").ClientSession() as http:
        async with http.get(c.url + "/health") as resp:
            assert resp.status == 503
        async with http.post(
            c.url + "/v1/completions", json={"model": "lumen-synthetic", "prompt": "hi"}
        ) as resp:
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "no_healthy_worker"


@pytest.mark.slow  # the default run keeps the recovering modes' real-process kills
async def test_mode_none_surfaces_the_failure(cluster_factory) -> None:
    c = cluster_factory(workers=3, mode="none")
    reqs = make_requests(30, seed=15)
    load = asyncio.create_task(run_requests(c.url, reqs))
    killed = await kill_busiest(c.url, "kill", min_running=5)
    results = await load
    failed = [r for r in results if not r.ok]
    assert failed, "mode 'none' must pass the failure to the client"
    assert all("recovery mode is 'none'" in (r.error or "") for r in failed)
    # requests on the survivors are untouched
    assert all(r.text == expected_text(r) for r in results if r.ok)
    # only the victim's requests fail: those it reported, or those the gateway had routed to it and it
    # had not reported yet (its heartbeats lag by an interval; more so on a busy machine)
    victim = killed["victim"]
    assert len(failed) <= max(victim["running"] + victim["waiting"], victim["inflight"]) + 2


async def test_stalled_engine_with_live_heartbeats_is_caught_by_the_stall_timeout(cluster_factory) -> None:
    # the engine loop freezes but the agent keeps heartbeating: only the per-chunk stall timeout sees it
    # a request queued on the stalled worker has no first chunk yet: it waits first_token_timeout_s
    # (120 s by default, for long prefills), not the stall timeout, so shorten both here
    c = cluster_factory(
        workers=3,
        mode="stop_restart",
        **{"recovery.stall_timeout_s": 0.5, "recovery.first_token_timeout_s": 3.0},
    )
    reqs = make_requests(30, seed=16)
    load = asyncio.create_task(run_requests(c.url, reqs))
    stalled = await kill_busiest(c.url, "stall", min_running=5)
    results = await load
    assert_exact(results)
    sessions = await admin(c.url, "GET", "/admin/sessions")
    mine = [i for i in sessions["interrupted"] if i["worker"] == stalled["worker"]]
    assert mine and all(i["reason"].startswith("stall") for i in mine)
    assert all(i["resumed_on"] != stalled["worker"] for i in mine)
    workers = {w["id"]: w for w in await admin(c.url, "GET", "/admin/workers")}
    assert workers[stalled["worker"]]["state"] == "HEALTHY"  # heartbeats kept it alive: a gray failure
    await admin(c.url, "POST", f"/admin/workers/{stalled['worker']}/kill?mode=unstall")


@pytest.mark.slow  # streaming resumes run by default (test_kill_busiest_worker_mid_generation)
async def test_non_streaming_chat_and_completions_resume_identically(cluster_factory) -> None:
    """Non-streamed chat and completions: outputs with a kill equal the outputs of a run without one."""
    import subprocess
    import sys

    import aiohttp

    c = cluster_factory(workers=3, mode="stop_restart")

    def bodies() -> list[tuple[str, dict[str, object]]]:
        out: list[tuple[str, dict[str, object]]] = []
        for i in range(24):
            sampling = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.8, "seed": 1000 + i}
            if i % 3 == 0:
                out.append(
                    (
                        "/v1/completions",
                        {
                            "model": "lumen-synthetic",
                            "prompt": f"request {i} " * 20,
                            "max_tokens": 150,
                            **sampling,
                        },
                    )
                )
            else:
                out.append(
                    (
                        "/v1/chat/completions",
                        {
                            "model": "lumen-synthetic",
                            "max_tokens": 150,
                            **sampling,
                            "messages": [{"role": "user", "content": f"tell me {i}"}],
                        },
                    )
                )
        return out

    async def run_all() -> list[str]:
        async with aiohttp.ClientSession(c.url) as http:

            async def one(path: str, body: dict[str, object]) -> str:
                async with http.post(path, json=body) as r:
                    data = await r.json()
                    assert r.status == 200, data
                choice = data["choices"][0]
                assert choice["finish_reason"] == "length"
                return choice["text"] if "text" in choice else choice["message"]["content"]

            return list(await asyncio.gather(*(one(p, b) for p, b in bodies())))

    reference = await run_all()
    load = asyncio.create_task(run_all())
    await kill_busiest(c.url, "kill", min_running=4)  # through the admin API, as the CLI does below
    assert await load == reference
    sessions = await admin(c.url, "GET", "/admin/sessions")
    assert sessions["interrupted"], "the kill must have interrupted some non-streamed requests"
    # the CLI's fault injection reaches the same endpoint
    out = await asyncio.to_thread(
        subprocess.run,
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "cluster",
            "kill",
            "--port",
            str(c.port),
            "w0",
            "--mode",
            "kill",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert '"worker": "w0"' in out.stdout
