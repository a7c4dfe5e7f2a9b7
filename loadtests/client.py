"""A streaming OpenAI-completions client that timestamps every chunk (for TTFT/TPOT and exactness)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass(slots=True)
class RequestResult:
    idx: int
    arrival: float  # monotonic, when the request was sent
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    seed: int | None
    status: int = 0
    text: str = ""
    error: str | None = None
    finish_reason: str | None = None
    chunk_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    rid: str = ""  # the gateway's request id (the response's "id")

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.finish_reason is not None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.arrival if self.chunk_times else None

    @property
    def tpot(self) -> float | None:
        if self.completion_tokens < 2 or len(self.chunk_times) < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.completion_tokens - 1)


async def stream_completion(
    http: aiohttp.ClientSession, base_url: str, model: str, r: RequestResult, api_key: str | None = None
) -> RequestResult:
    body: dict[str, object] = {
        "model": model,
        "prompt": r.prompt_ids,
        "max_tokens": r.max_tokens,
        "temperature": r.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if r.seed is not None:
        body["seed"] = r.seed
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r.arrival = time.monotonic()
    try:
        async with http.post(f"{base_url}/v1/completions", json=body, headers=headers) as resp:
            r.status = resp.status
            if resp.status != 200:
                r.error = (await resp.text())[:300]
                return r
            parts: list[str] = []
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                obj = json.loads(payload)
                r.rid = r.rid or obj.get("id", "")
                if "error" in obj:
                    r.error = obj["error"].get("message", "error")
                    break
                for ch in obj.get("choices", []):
                    if ch.get("text"):
                        parts.append(ch["text"])
                        r.chunk_times.append(time.monotonic())
                    if ch.get("finish_reason"):
                        r.finish_reason = ch["finish_reason"]
                if obj.get("usage"):
                    r.completion_tokens = obj["usage"]["completion_tokens"]
            r.text = "".join(parts)
            if r.finish_reason is None and r.error is None:
                r.error = "stream truncated"
    except (aiohttp.ClientError, TimeoutError) as exc:
        r.error = f"{type(exc).__name__}: {exc}"
    return r
