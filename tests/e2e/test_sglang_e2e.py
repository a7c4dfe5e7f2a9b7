"""End to end on loopback with real processes: three stand-in SGLang servers (both streaming forms),
`lumen gateway --sglang-url …` in front of them (agentless), and the busiest server killed -9 mid-stream:
every stream completes with the no-failure text, greedy and seeded, and no body the gateway sent was
refused by SGLang's contract."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.protocol.secrets import admin_headers
from gateway.protocol.sglang import sglang_seed
from loadtests.client import RequestResult, stream_completion
from tests.fixtures.sglang_standin import expected_ids

ROOT = Path(__file__).resolve().parents[2]
MODEL = "standin"


class Proc:
    """A child process that prints one JSON line when ready; killed by its pid at the end."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = log.open("w")
        self.p = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.p.stdout.readline() if self.p.stdout else ""
        if not line:
            raise RuntimeError(f"{argv[:4]} exited before it was ready; see {log}")
        self.ready: dict[str, Any] = json.loads(line)

    def kill(self) -> None:
        if self.p.poll() is None:
            os.kill(self.p.pid, signal.SIGKILL)
        self.p.wait(10)
        if self.p.stdout is not None:
            self.p.stdout.close()
        self.log.close()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in started:
        p.kill()


def start_standin(procs: list[Proc], tmp_path: Path, i: int) -> Proc:
    argv = [sys.executable, "-m", "tests.fixtures.sglang_standin", "--port", "0", "--token-delay-ms", "20"]
    if i % 2:
        argv.append("--incremental-streaming-output")
    p = Proc(argv, tmp_path / f"standin{i}.log")
    procs.append(p)
    return p


def requests(n: int) -> list[RequestResult]:
    out = []
    for i in range(n):
        prompt = list(b"An end-to-end request, number %d, long enough to matter." % i)
        seeded = i % 2 == 1
        out.append(
            RequestResult(
                idx=i,
                arrival=0.0,
                prompt_ids=prompt,
                max_tokens=80,
                temperature=0.7 if seeded else 0.0,
                seed=1000 + i if seeded else None,
            )
        )
    return out


def expected_text(r: RequestResult) -> str:
    seed = sglang_seed(r.seed) if r.seed is not None else None
    return bytes(expected_ids(r.prompt_ids, r.max_tokens, r.temperature, seed)).decode()


async def get_json(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url, headers=admin_headers(url)) as resp:
        return await resp.json()


async def test_gateway_over_three_sglang_servers_survives_a_kill(procs: list[Proc], tmp_path: Path) -> None:
    servers = [start_standin(procs, tmp_path, i) for i in range(3)]
    urls = [s.ready["url"] for s in servers]
    gw = Proc(
        [
            sys.executable, "-m", "gateway.cli", "gateway", "--port", "0", "--control-port", "0",
            "--mode", "lumen", *[a for u in urls for a in ("--sglang-url", u)],
            "--set", f'gateway.served_model_name="{MODEL}"', "--set", "gateway.log_level=\"info\"",
        ],
        tmp_path / "gateway.log",
    )  # fmt: skip
    procs.append(gw)
    base = gw.ready["url"]
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        async with asyncio.timeout(20):
            while (await get_json(http, f"{base}/health")).get("healthy_workers") != 3:
                await asyncio.sleep(0.05)
        reqs = requests(9)
        tasks = [asyncio.create_task(stream_completion(http, base, MODEL, r)) for r in reqs]
        # mid-stream: every server runs something and has streamed some tokens
        async with asyncio.timeout(20):
            while True:
                loads = [await get_json(http, f"{u}/v1/loads") for u in urls]
                running = [sum(r["num_running_reqs"] for r in ld["loads"]) for ld in loads]
                if sum(running) == len(reqs) and all(len(r.chunk_times) >= 10 for r in reqs):
                    break
                await asyncio.sleep(0.02)
        victim = max(range(3), key=lambda i: running[i])
        killed_at = time.monotonic()
        os.kill(servers[victim].p.pid, signal.SIGKILL)
        results = await asyncio.gather(*tasks)
        assert [(r.idx, r.error) for r in results if not r.ok] == []
        assert [r.idx for r in results if r.text != expected_text(r)] == []
        for i, u in enumerate(urls):
            if i != victim:
                stats = await get_json(http, f"{u}/standin/stats")
                assert stats["refused"] == [], stats["refused"]
        events = await get_json(http, f"{base}/admin/events")
        failed = [e for e in events if e["to"] == "FAILED"]
        assert len(failed) >= 1 and all(e["worker"] == f"sglang-{victim}" for e in failed)
        interrupted = (await get_json(http, f"{base}/admin/sessions"))["interrupted"]
        assert interrupted and {it["worker"] for it in interrupted} == {f"sglang-{victim}"}
        assert all(it["resumed_on"] not in (None, f"sglang-{victim}") for it in interrupted)
        assert time.monotonic() - killed_at < 30
