"""Tune on your own traffic (issue 30 item 2): a gateway with `gateway.record_trace` records the load
Lumen's own load client sends (arrival, prompt and output tokens, no text) in the CSV layout `lumen sim
--trace` reads, rotated by size; `lumen tune --trace` on that file recommends θ/τ beside today's values
and prints the command that applies it; that command, run as printed, changes the live gateway."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import aiohttp

from gateway.server.trace_recorder import HEADER, TraceRecorder
from gateway.sim.workload import read_trace
from loadtests.client import RequestResult, stream_completion
from tests.integration.test_gateway_inprocess import cluster

N = 40
MAX_TOKENS = 12


def test_rows_are_read_by_the_simulator_and_rotated_by_size(tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    rec = TraceRecorder(path, max_bytes=4096)
    t0 = 1_790_000_000.0
    for i in range(200):  # ~40 bytes a row: rotated once past 4096 bytes
        rec.record(t0 + i * 0.25, 100 + i, 7)
    rec.close()
    old, new = path.with_name("trace.csv.1"), path
    assert old.exists() and old.read_text().startswith(HEADER) and new.read_text().startswith(HEADER)
    w_old, w_new = read_trace(old), read_trace(new)
    assert len(w_old) + len(w_new) == 200
    assert list(w_new.outputs) == [7] * len(w_new)
    assert abs(float(w_old.arrivals[1]) - 0.25) < 1e-6  # microsecond timestamps, relative to the first


async def test_a_recorded_trace_feeds_tune_and_its_command_applies_live(tmp_path: Path) -> None:
    trace = tmp_path / "traffic.csv"
    overrides = {"gateway.record_trace": str(trace), "recovery.theta": 4.0, "recovery.tau": 2048}
    async with cluster(2, **overrides) as (gw, _workers, _http):
        url = f"http://127.0.0.1:{gw.http_port}"
        async with aiohttp.ClientSession() as http:
            reqs = [
                RequestResult(i, 0.0, list(range(32, 32 + 10 + i)), MAX_TOKENS, 0.0, None) for i in range(N)
            ]
            t0 = time.time()
            await asyncio.gather(*(stream_completion(http, url, "lumen-synthetic", r) for r in reqs))
        assert all(r.error is None for r in reqs), [r.error for r in reqs if r.error]
        w = read_trace(trace)
        assert len(w) == N and set(w.outputs.tolist()) == {MAX_TOKENS}
        assert sorted(w.prompts.tolist()) == sorted(len(r.prompt_ids) for r in reqs)
        assert b"32,33,34" not in trace.read_bytes()  # nothing of the prompts themselves
        assert float(w.arrivals[-1]) < time.time() - t0 + 1

        out = tmp_path / "tune"
        tune = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway.cli", "tune", "--scenario", "paper-4w", "--trace", str(trace),
            "--fail-at", "0.5", "--theta", "2,3", "--tau", "256,512", "--current", "4.0,2048",
            "--port", str(gw.http_port), "--out", str(out), "--no-plots", "--quiet",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        stdout, stderr = await tune.communicate()
        assert tune.returncode == 0, stderr.decode()
        text = stdout.decode()
        assert "recommended" in text and "today" in text and "damage" in text and "common-window TTFT" in text
        apply = next(line for line in text.splitlines() if line.startswith("apply it live: "))
        command = apply.removeprefix("apply it live: ").split()
        assert command[:4] == ["lumen", "cluster", "config", "set"]
        theta = float(command[4].split("=")[1])
        tau = int(command[5].split("=")[1])
        run = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway.cli", *command[1:],
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        said, err = await run.communicate()
        assert run.returncode == 0, said.decode() + err.decode()
        assert gw.config.recovery.theta == theta and gw.config.recovery.tau == tau
        changed = (theta, tau) != (4.0, 2048)
        assert gw.live.generation == 1 + changed
        assert f"gateway :{gw.http_port}  generation {gw.live.generation}" in said.decode()
