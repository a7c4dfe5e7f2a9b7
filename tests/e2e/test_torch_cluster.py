"""The local cluster with `engine.backend = "torch"`: three worker processes each running the tiny
random model (fp32, CPU), real KV pages streamed to holders, a worker killed mid-stream. Every client
stream must finish without an error and with exactly the ids of an uninterrupted run."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import aiohttp
import pytest

pytest.importorskip("torch")

from gateway.protocol.generate import SamplingParams
from tests.e2e.conftest import admin, kill_busiest, wait_for
from worker_hooks.engine.torch_backend import expected_outputs

PS = 16
TORCH: dict[str, Any] = {
    "engine.backend": "torch",
    "torch.model": "tiny",
    "torch.draft": "self:1",
    "engine.page_size": PS,
    "engine.kv_capacity_tokens": 16384,
    "engine.max_running_requests": 32,
    "engine.draft_load_s": 0.2,
    "checkpoint.budget_bytes": 256 << 20,
    "recovery.tau": 0,
}


def workload(n: int, seed: int) -> list[tuple[list[int], SamplingParams, int]]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        params = SamplingParams(
            max_new_tokens=rnd.randrange(80, 140),
            temperature=0.0 if i % 2 == 0 else 0.8,
            top_p=1.0 if i % 2 == 0 else 0.95,
            ignore_eos=True,
        )
        out.append(
            ([rnd.randrange(0, 256) for _ in range(rnd.randrange(16, 200))], params, rnd.randrange(1, 2**31))
        )
    return out


async def generate(
    http: aiohttp.ClientSession, url: str, prompt: list[int], sp: SamplingParams, seed: int
) -> Any:
    """One streamed SGLang-native /generate through the gateway: (output ids, error)."""
    body = {
        "input_ids": prompt,
        "stream": True,
        "sampling_params": {
            "max_new_tokens": sp.max_new_tokens,
            "temperature": sp.temperature,
            "top_p": sp.top_p,
            "ignore_eos": True,
            "sampling_seed": seed,
        },
    }
    ids: list[int] = []
    async with http.post(f"{url}/generate", json=body) as resp:
        if resp.status != 200:
            return ids, f"HTTP {resp.status}: {await resp.text()}"
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                return ids, chunk["error"]
            ids = chunk["output_ids"]
    return ids, None


@pytest.mark.slow  # torch workers in process (restore, drafting): integration/test_torch_engine.py
async def test_torch_cluster_survives_a_kill_with_exact_outputs(cluster_factory: Any) -> None:
    reqs = workload(24, seed=5)
    truth = expected_outputs(reqs, model="tiny", page_size=PS)
    c = cluster_factory(workers=3, mode="lumen", **TORCH)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=240)) as http:
        load = asyncio.gather(*(generate(http, c.url, p, sp, seed) for p, sp, seed in reqs))
        await wait_for(c.url, lambda ws: sum(w["ckpt_tokens"] for w in ws) > 1000, 60, "checkpoints")
        killed = await kill_busiest(c.url, "kill", min_running=3)
        results = await load
    errors = [(i, err) for i, (_, err) in enumerate(results) if err is not None]
    assert errors == []
    wrong = [i for i, ((ids, _), want) in enumerate(zip(results, truth, strict=True)) if ids != want]
    assert wrong == [], f"outputs differ from the uninterrupted run: {wrong}"
    inter = [
        i
        for i in (await admin(c.url, "GET", "/admin/sessions"))["interrupted"]
        if i["worker"] == killed["worker"]
    ]
    assert inter, "the killed worker was serving nobody"
    assert any(i["action"] == "restore" and i["restored_tokens"] > 0 for i in inter), inter
    # the killed worker comes back (draft model first, then the full one) and serves again
    await wait_for(c.url, lambda ws: all(w["state"] == "HEALTHY" for w in ws), 60, "the restart to rejoin")
