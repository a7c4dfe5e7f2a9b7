"""The load of the overhead bench: the seeded open-loop request mix, the clients of each path (streamed
`/generate` and `/v1/completions`), and a process's CPU seconds from /proc."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from loadtests.client import RequestResult, stream_completion


@dataclass(slots=True)
class Sample:
    sched: float  # seconds after the run's start when the request was due
    sent: float = 0.0
    done: float = 0.0
    ttft: float | None = None
    tpot: float | None = None
    tokens: int = 0
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Shape:
    at: float
    prompt_ids: list[int]
    output_tokens: int


@dataclass(slots=True)
class Target:
    """How one path is reached: URL(s), request kind, and which processes count as its gateway."""

    name: str
    urls: list[str]
    kind: str  # "generate" | "completions"
    model: str = ""
    string_prompt: bool = False
    pids: dict[str, int] = field(default_factory=dict)  # whose CPU is this path's gateway CPU
    baseline: str = "direct"
    api_key: str = ""  # the bearer to send (Lumen's workers take only their cluster's)


def workload(rate: float, seconds: float, min_requests: int, seed: int) -> list[Shape]:
    rnd = random.Random(seed)
    n = max(min_requests, round(rate * seconds))
    out, t = [], 0.0
    for _ in range(n):
        out.append(
            Shape(t, [rnd.randrange(32, 127) for _ in range(rnd.randint(32, 512))], rnd.randint(16, 128))
        )
        t += rnd.expovariate(rate)
    return out


def cpu_seconds(pid: int) -> float:
    """utime + stime of the process itself (its children, e.g. Lumen's workers, are not counted)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- clients --------------------------------------------------------------------------------------
async def _generate(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], s: Sample, api_key: str = ""
) -> None:
    s.sent = time.monotonic()
    first = last = 0.0
    finish: Any = None
    done_marker = False
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        async with http.post(url + "/generate", json=body, headers=headers) as resp:
            if resp.status != 200:
                s.error = f"{resp.status}: {(await resp.text())[:200]}"
                return
            async for raw in resp.content:
                done_marker = done_marker or raw.startswith(b"data: [DONE]")
                if not raw.startswith(b"data:") or done_marker:
                    continue
                obj = json.loads(raw[5:])
                if "error" in obj:
                    s.error = str(obj["error"])[:200]
                    return
                meta = obj.get("meta_info", {})
                # workers stream only new ids, Lumen's /generate the cumulative list (SGLang's default):
                # the cumulative completion_tokens counts both
                n = meta.get("completion_tokens", s.tokens + len(obj.get("output_ids", ())))
                if n > s.tokens:
                    last = time.monotonic()
                    first = first or last
                    s.tokens = n
                finish = finish or meta.get("finish_reason")
    except (aiohttp.ClientError, TimeoutError) as exc:
        s.error = f"{type(exc).__name__}: {exc}"
        return
    want = body["sampling_params"]["max_new_tokens"]
    if not finish:
        s.error = f"stream truncated after {s.tokens} of {want} tokens ([DONE] {'seen' if done_marker else 'missing'})"
        return
    if isinstance(finish, dict) and finish.get("type") == "abort":
        s.error = f"aborted after {s.tokens} of {want} tokens: {finish.get('message')}"
        return
    if s.tokens != want:  # ignore_eos: every request must produce exactly max_new_tokens
        s.error = f"short: {s.tokens} of {want} tokens, finish {finish}"
        return
    s.ttft = first - s.sent
    s.tpot = (last - first) / (s.tokens - 1) if s.tokens > 1 else None


async def _one(http: aiohttp.ClientSession, t: Target, i: int, shape: Shape, s: Sample) -> None:
    url = t.urls[i % len(t.urls)]
    if t.kind == "generate":
        body = {
            "rid": f"bench-{t.name[:6]}-{i:010d}",
            "input_ids": shape.prompt_ids,
            "sampling_params": {
                "max_new_tokens": shape.output_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
            },
            "stream": True,
        }
        await _generate(http, url, body, s, t.api_key)
        s.done = time.monotonic()
        return
    r = RequestResult(i, 0.0, shape.prompt_ids, shape.output_tokens, 0.0, None)
    if t.string_prompt:  # SMG's completions take text only; ids 32..126 are printable ASCII bytes
        r.prompt_ids = "".join(map(chr, shape.prompt_ids))  # type: ignore[assignment]
    await stream_completion(http, url, t.model, r, t.api_key or None)
    s.done, s.sent = time.monotonic(), r.arrival
    s.tokens = r.completion_tokens
    if not r.ok:
        s.error = r.error or f"status {r.status}"
    elif r.completion_tokens != shape.output_tokens:
        s.error = f"short: {r.completion_tokens} of {shape.output_tokens} tokens, finish {r.finish_reason}"
    else:
        s.ttft, s.tpot = r.ttft, r.tpot


async def drive(http: aiohttp.ClientSession, t: Target, shapes: list[Shape]) -> tuple[list[Sample], float]:
    """Open loop: request i is sent at shapes[i].at whatever happened before. Returns samples, t0."""
    samples = [Sample(sh.at) for sh in shapes]
    t0 = time.monotonic()

    async def at(i: int) -> None:
        await asyncio.sleep(max(0.0, t0 + shapes[i].at - time.monotonic()))
        await _one(http, t, i, shapes[i], samples[i])

    await asyncio.gather(*(at(i) for i in range(len(shapes))))
    return samples, t0
