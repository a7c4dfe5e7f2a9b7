"""SGLang sidecar agents end to end: real processes on loopback, SGLang stand-ins launched by the agents.

`lumen cluster up --engine sglang` and `lumen sglang-agent` run with LUMEN_SGLANG_LAUNCHER pointing at
the launch shim (tests/e2e/sglang_launch_shim.py: it refuses to start unless the agent added the flags
Lumen needs, then runs tests/fixtures/sglang_standin.py). Every process a test starts is stopped by pid
in its `finally`, and every stand-in pid an agent reported is checked gone at the end.

Clocks: `/admin/events` times are seconds since the gateway started, on its `time.monotonic()`;
`lumen cluster up` prints that start (`started_at_monotonic`) in its ready line. On Linux
`time.monotonic()` is CLOCK_MONOTONIC, one clock for every process of the host, so the test's own
`time.monotonic()` and the gateway's event times can be compared directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.protocol.secrets import admin_headers
from gateway.protocol.sglang import sglang_seed
from loadtests.client import RequestResult, stream_completion
from loadtests.cluster_proc import free_port
from tests.fixtures.sglang_standin import expected_ids

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="needs Linux: one CLOCK_MONOTONIC across processes"
)

SHIM = f"{sys.executable} -m tests.e2e.sglang_launch_shim"
ROOT = Path(__file__).resolve().parents[2]
E2E_SETTINGS = [
    "--set",
    "health.heartbeat_interval_ms=50",
    "--set",
    "health.heartbeat_misses=4",
    "--set",
    'gateway.log_level="info"',
    # a stopping gateway cancels the agents' control streams after 0.05 s, not 0.5 s (the teardown)
    "--set",
    "timeouts.control_stop_grace_s=0.05",
    # a test cluster: /admin/workers/{id}/kill signals its servers (issue 29: test clusters only)
    "--set",
    "cluster.fault_injection=true",
]


class Proc:
    """A child process whose stdout is one JSON object a line; `events` fills as they come."""

    def __init__(self, proc: asyncio.subprocess.Process, stderr_path: Path) -> None:
        self.proc = proc
        self.stderr_path = stderr_path
        self.events: list[dict[str, Any]] = []
        self._new = asyncio.Event()
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def start(cls, argv: list[str], log: Path, env: dict[str, str] | None = None) -> Proc:
        with log.open("wb") as err:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
                cwd=ROOT,
                env={**os.environ, **(env or {})},
            )
        return cls(proc, log)

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            with contextlib.suppress(json.JSONDecodeError):
                ev = json.loads(line)
                if isinstance(ev, dict):
                    self.events.append(ev)
                    self._new.set()
        self._new.set()

    async def event(self, name: str, within: float = 30.0, after: int = 0) -> dict[str, Any]:
        """The first event called `name` (from index `after` on), waiting for it."""
        async with asyncio.timeout(within):
            while True:
                self._new.clear()
                for ev in self.events[after:]:
                    if ev.get("event") == name:
                        return ev
                if self._reader.done():
                    raise AssertionError(f"exited before {name!r}: {self.stderr_tail()}")
                await self._new.wait()

    async def stop(self, grace_s: float = 15.0) -> int:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(self.proc.wait(), grace_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()
        await self._reader
        assert self.proc.returncode is not None
        return self.proc.returncode

    def stderr_tail(self, n: int = 3000) -> str:
        try:
            return self.stderr_path.read_text()[-n:]
        except OSError:
            return ""


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead too (its parent has not reaped it yet)
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
            return False
    return True


def standin_pids(log_dir: Path) -> set[int]:
    """Every SGLang server pid the cluster's agents reported (their stdout is kept in <id>.log)."""
    pids = set()
    for log in log_dir.glob("*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith('{"event": "server_started"'):
                pids.add(int(json.loads(line)["pid"]))
    return pids


@contextlib.asynccontextmanager
async def sglang_cluster(tmp_path: Path, workers: int, *extra: str) -> AsyncIterator[tuple[str, float, Path]]:
    """`lumen cluster up --engine sglang` on stand-ins: (url, gateway start on time.monotonic(), logs)."""
    logs = tmp_path / "cluster"
    argv = [
        sys.executable, "-m", "gateway.cli", "cluster", "up", "--engine", "sglang", "--model", "standin",
        "--workers", str(workers), "--port", str(free_port()), "--log-dir", str(logs), *E2E_SETTINGS,
        "--", *extra,
    ]  # fmt: skip
    cluster = await Proc.start(argv, tmp_path / "cluster.stderr", {"LUMEN_SGLANG_LAUNCHER": SHIM})
    try:
        ready = await cluster.event("ready", within=45)
        assert ready["engine"] == "sglang" and ready["healthy_workers"] == workers
        yield ready["url"], ready["started_at_monotonic"], logs
    finally:
        assert await cluster.stop() == 0, cluster.stderr_tail()
        left = [pid for pid in standin_pids(logs) if pid_alive(pid)]
        assert left == [], f"stand-ins left running: {left}"


async def admin(http: aiohttp.ClientSession, url: str, method: str, path: str) -> Any:
    async with http.request(method, url + path, headers=admin_headers(url)) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def workers_when(http: aiohttp.ClientSession, url: str, pred: Any, within: float = 20.0) -> Any:
    """/admin/workers once `pred` holds for it (the gateway has no push API for worker state)."""
    async with asyncio.timeout(within):
        while not pred(ws := await admin(http, url, "GET", "/admin/workers")):
            await asyncio.sleep(0.02)
    return ws


async def generate(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    last: dict[str, Any] = {}
    async with http.post(url + "/generate", json={**body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.strip()
            if line.startswith(b"data:") and line != b"data: [DONE]":
                last = json.loads(line[5:])
    return last


def request(i: int, n: int) -> tuple[dict[str, Any], list[int]]:
    """Request i (even: greedy, odd: seeded) and the ids a failure-free server returns for it."""
    prompt = [32 + (i * 11 + j) % 90 for j in range(16 + 3 * i)]
    temperature, seed = (0.0, None) if i % 2 == 0 else (0.8, 7919 * i)
    sp: dict[str, Any] = {"max_new_tokens": n, "temperature": temperature}
    if seed is not None:
        sp["sampling_seed"] = seed
    want = expected_ids(prompt, n, temperature, None if seed is None else sglang_seed(seed))
    return {"input_ids": prompt, "sampling_params": sp}, want


async def test_a_busy_sglang_server_killed_mid_stream_is_invisible_to_clients(tmp_path: Path) -> None:
    """`lumen cluster up --engine sglang`, 16 streams (greedy and seeded) over two stand-ins, the busier
    one killed through its own fault endpoint while it streams; every client gets exactly the
    failure-free ids. Detection latency: the test reads time.monotonic() just before it sends the kill
    (`sent`); the stand-in dies after that; the gateway's FAILED event on the same clock is
    `started_at_monotonic + t`. So `FAILED - sent` is an upper bound on kill-to-FAILED (it also holds the
    fault request's own round trip)."""
    async with (
        sglang_cluster(tmp_path, 2, "--token-delay-ms", "25") as (url, started, _logs),
        aiohttp.ClientSession() as http,
    ):
        cases = [request(i, 80) for i in range(16)]
        streams = [asyncio.create_task(generate(http, url, body)) for body, _ in cases]
        ws = await workers_when(http, url, lambda ws: any(w["running"] >= 4 for w in ws))
        victim = max(ws, key=lambda w: (w["running"], w["id"]))
        sent = time.monotonic()
        async with http.post(victim["url"] + "/standin/fault", json={"kind": "kill"}) as resp:
            assert resp.status == 200
        results = await asyncio.gather(*streams)
        for (_, want), got in zip(cases, results, strict=True):
            assert got["output_ids"] == want
            assert got["meta_info"]["finish_reason"]["type"] == "length"

        events = await admin(http, url, "GET", "/admin/events")
        failed = [e for e in events if e["worker"] == victim["id"] and e["to"] == "FAILED"]
        assert failed and failed[0]["incarnation"] == victim["incarnation"]
        latency = started + failed[0]["t"] - sent
        print(f"\nmid-stream kill -> FAILED <= {1000 * latency:.1f} ms ({failed[0]['reason']})")
        assert latency < 0.1
        cut = [
            i for i in (await admin(http, url, "GET", "/admin/sessions"))["interrupted"]
            if i["worker"] == victim["id"]
        ]  # fmt: skip
        assert len(cut) >= 4 and all(i["resumed_on"] not in (None, victim["id"]) for i in cut)
        # the agent restarts its server; the gateway takes it back as a new incarnation
        await workers_when(
            http,
            url,
            lambda ws: any(
                w["id"] == victim["id"]
                and w["state"] == "HEALTHY"
                and w["incarnation"] > victim["incarnation"]
                for w in ws
            ),
        )


@pytest.mark.slow  # the Lumen-worker twin (test_gateway_failover.py) runs by default
async def test_two_gateways_over_sglang_agents_a_gateway_killed_mid_stream_loses_no_token(
    tmp_path: Path,
) -> None:
    """`lumen cluster up --engine sglang --gateways 2`: every agent attaches to both gateways; 8 streams
    (greedy and seeded) on gateway 0, which is killed -9 mid-stream; each client re-sends its request
    to gateway 1 with Last-Event-ID and its text equals the text gateway 1 gives the same request
    without a failure. The supervisor restarts gateway 0 and both servers attach to it again. In mode
    lumen every server was launched with Lumen's HiCache storage backend under its own worker id
    (the launch shim checks the flags as Lumen's backend would, and records them)."""
    logs = tmp_path / "cluster"
    argv = [
        sys.executable, "-m", "gateway.cli", "cluster", "up", "--engine", "sglang", "--model", "standin",
        "--workers", "2", "--gateways", "2", "--port", str(free_port()), "--log-dir", str(logs), *E2E_SETTINGS,
        "--", "--token-delay-ms", "20",
    ]  # fmt: skip
    record = tmp_path / "starts.jsonl"
    env = {"LUMEN_SGLANG_LAUNCHER": SHIM, "LUMEN_SHIM_RECORD": str(record)}
    cluster = await Proc.start([*argv[:5], "--mode", "lumen", *argv[5:]], tmp_path / "cluster.stderr", env)
    try:
        ready = await cluster.event("ready", within=60)
        assert ready["engine"] == "sglang" and ready["healthy_workers"] == 2 and len(ready["urls"]) == 2
        starts = [json.loads(line) for line in record.read_text().splitlines()]
        assert sorted(s["hicache"]["lumen"]["worker_id"] for s in starts) == ["w0", "w1"]
        urls = ready["urls"]

        def requests() -> list[RequestResult]:
            return [
                RequestResult(
                    idx=i, arrival=0.0, prompt_ids=[32 + (i * 7 + j) % 90 for j in range(12 + i)], max_tokens=60,
                    temperature=0.0 if i % 2 == 0 else 0.8, seed=None if i % 2 == 0 else 7919 * i,
                )
                for i in range(8)
            ]  # fmt: skip

        cut, ref = requests(), requests()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
            for url in urls:  # every gateway sees both servers
                await workers_when(http, url, lambda ws: [w["state"] for w in ws] == ["HEALTHY"] * 2)
            tasks = [
                asyncio.create_task(stream_completion(http, urls[0], "standin", r, resume_urls=[urls[1]]))
                for r in cut
            ]
            async with asyncio.timeout(30):  # mid-stream: every client has some text
                while not all(len(r.chunk_times) >= 5 for r in cut):
                    await asyncio.sleep(0.02)
            os.kill(ready["gateway_pids"][0], signal.SIGKILL)
            await asyncio.gather(*tasks)
            await asyncio.gather(*(stream_completion(http, urls[1], "standin", r) for r in ref))
            for a, b in zip(cut, ref, strict=True):
                assert a.ok and b.ok, (a.error, b.error)
                assert a.resumes == 1 and a.completion_tokens == b.completion_tokens == 60
                assert a.text == b.text
            # gateway 0 comes back on its port, and both servers attach to it again
            await workers_when(http, urls[0], lambda ws: [w["state"] for w in ws] == ["HEALTHY"] * 2, 60)
    finally:
        assert await cluster.stop() == 0, cluster.stderr_tail()
        left = [pid for pid in standin_pids(logs) if pid_alive(pid)]
        assert left == [], f"stand-ins left running: {left}"


@pytest.mark.slow  # the default run keeps the agent kill-detection e2e and its in-process twin
async def test_a_server_killed_by_the_cluster_is_failed_within_100_ms_on_the_gateways_clock(
    tmp_path: Path,
) -> None:
    """`/admin/workers/{id}/kill` SIGKILLs the SGLang server (the pid its agent reported), not the
    agent. The kill result's `at` and the FAILED event's `t` are both read from the gateway's clock
    (`at` right after the signal was sent, in the same handler), so `t - at` is the detection latency:
    the agent's child-exit watcher sees the exit and cancels its control stream. No stream is open
    to the server, so nothing else can tell the gateway."""
    async with sglang_cluster(tmp_path, 1) as (url, _started, _logs), aiohttp.ClientSession() as http:
        [before] = await admin(http, url, "GET", "/admin/workers")
        assert before["pid"] > 0  # Hello names the server's pid
        killed = await admin(http, url, "POST", f"/admin/workers/{before['id']}/kill?mode=kill")
        assert killed["pid"] == before["pid"]
        ws = await workers_when(
            http,
            url,
            lambda ws: ws[0]["state"] == "HEALTHY" and ws[0]["incarnation"] > before["incarnation"],
        )
        assert ws[0]["pid"] not in (0, before["pid"])  # a new server process, and the gateway knows its pid
        events = await admin(http, url, "GET", "/admin/events")
        failed = next(e for e in events if e["to"] == "FAILED")
        latency = failed["t"] - killed["at"]
        print(f"\nSIGKILL -> FAILED {1000 * latency:.1f} ms ({failed['reason']})")
        # the old stream's end and the restarted server's Hello race to the gateway; both fail it
        assert failed["reason"] in ("control stream ended", "replaced by a new incarnation")
        assert 0 <= latency < 0.1
        # a fault that means nothing to an SGLang server is refused, not sent as a signal
        async with http.post(
            url + f"/admin/workers/{before['id']}/kill?mode=stall", headers=admin_headers(url)
        ) as resp:
            assert resp.status == 400, await resp.text()


async def test_one_agent_attaches_to_two_gateways_and_takes_its_server_down_with_it(tmp_path: Path) -> None:
    """`lumen sglang-agent --gateway A --gateway B --launch`: one control session per gateway; SIGTERM
    stops the agent, its server goes with it, and both gateways fail the incarnation."""
    gateways = []
    agent = None
    # gateways of one cluster share its secret (each would generate its own otherwise)
    secret = {"LUMEN_CONTROL_TOKEN": "two-gateways-one-cluster-secret"}
    try:
        for name in ("a", "b"):
            argv = [
                sys.executable, "-m", "gateway.cli", "gateway", "--port", str(free_port()), "--control-port",
                "0", *E2E_SETTINGS,
            ]  # fmt: skip
            gateways.append(await Proc.start(argv, tmp_path / f"gateway-{name}.stderr", secret))
        ready = [await g.event("ready", within=30) for g in gateways]
        server_url = f"http://127.0.0.1:{free_port()}"
        argv = [
            sys.executable, "-m", "gateway.cli", "sglang-agent", "--url", server_url, "--id", "sg0",
            *(a for r in ready for a in ("--gateway", f"127.0.0.1:{r['control_port']}")),
            "--launch", "--", "--model-path", "standin", "--token-delay-ms", "5",
        ]  # fmt: skip
        agent = await Proc.start(argv, tmp_path / "agent.stderr", {"LUMEN_SGLANG_LAUNCHER": SHIM, **secret})
        server = await agent.event("server_started")
        async with aiohttp.ClientSession() as http:
            for r in ready:
                await workers_when(http, r["url"], lambda ws: [w["state"] for w in ws] == ["HEALTHY"])
            body, want = request(1, 20)
            for r in ready:  # each gateway streams through the same server
                assert (await generate(http, r["url"], body))["output_ids"] == want
            assert await agent.stop() == 0
            assert not pid_alive(server["pid"])
            for r in ready:
                await workers_when(http, r["url"], lambda ws: [w["state"] for w in ws] == ["FAILED"], 5)
    finally:
        if agent is not None:
            await agent.stop()
        for g in gateways:
            await g.stop()


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
@pytest.mark.parametrize(
    "argv",
    [
        ["cluster", "up", "--engine", "sglang", "--model", "x", "--port", "0"],
        ["sglang-agent", "--url", "http://127.0.0.1:30000", "--gateway", "127.0.0.1:1", "--launch"],
    ],
    ids=["cluster-up", "sglang-agent"],
)
async def test_without_sglang_the_sglang_commands_exit_2_saying_how_to_install_it(argv: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "LUMEN_SGLANG_LAUNCHER"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", *argv,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT, env=env,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 2, (out, err)
    assert b"sglang is not installed" in err and b"pip install 'lumen[sglang]'" in err
