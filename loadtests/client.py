"""A streaming OpenAI-completions client that timestamps every chunk (for TTFT/TPOT and exactness)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import aiohttp

from gateway.protocol.streamid import RESUMABLE_HEADERS


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
    resumes: int = 0  # times the stream broke and was resumed on a gateway (Last-Event-ID)

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
    http: aiohttp.ClientSession,
    base_url: str,
    model: str,
    r: RequestResult,
    api_key: str | None = None,
    *,
    resume_urls: Sequence[str] = (),
    max_resumes: int = 4,
) -> RequestResult:
    """Stream one completion. When the stream breaks (the gateway died: connection error, or no
    [DONE]) after some event, the same body goes to the next gateway of `resume_urls` (round robin,
    the first one again included) with `Last-Event-ID`, and the text continues from there."""
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
    # Lumen's own client asks for a resumable stream (`id:` lines, Last-Event-ID): plain ones get none
    headers = dict(RESUMABLE_HEADERS, **({"Authorization": f"Bearer {api_key}"} if api_key else {}))
    urls = [base_url, *[u for u in resume_urls if u != base_url]]
    r.arrival = time.monotonic()
    parts: list[str] = []
    at: list[str] = []  # the last event id seen, kept across a break
    for attempt in range(max_resumes + 1):
        url = urls[attempt % len(urls)]
        sent = dict(headers, **({"Last-Event-ID": at[-1]} if at else {}))
        try:
            end = await _read_stream(http, f"{url}/v1/completions", body, sent, r, parts, at)
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            r.error = f"{type(exc).__name__}: {exc}"
            end = "broken"
        # only a broken stream resumes: [DONE], an error event or an error status is the answer
        if end != "broken" or r.status != 200 or not at or not resume_urls:
            break
        r.resumes += 1
        r.error = None
    r.text = "".join(parts)
    if r.finish_reason is None and r.error is None:
        r.error = "stream truncated"
    return r


async def _read_stream(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, object],
    headers: dict[str, str],
    r: RequestResult,
    parts: list[str],
    at: list[str],
) -> str:
    """Read one stream into `r`/`parts` (and each complete event's id into `at`); how it ended
    ("done": [DONE], "error": an error status or event, "broken": neither)."""
    async with http.post(url, json=body, headers=headers) as resp:
        r.status = resp.status
        if resp.status != 200:
            r.error = (await resp.text())[:300]
            return "error"
        async for event_id, data in sse_events(resp.content):
            for payload in data:
                if payload == b"[DONE]":
                    return "done"
                if _take(json.loads(payload), r, parts) == "error":
                    return "error"
            if event_id is not None:
                at.append(event_id)
    return "broken"


async def sse_events(content: aiohttp.StreamReader) -> AsyncIterator[tuple[str | None, list[bytes]]]:
    """A response's SSE events as (id, data payloads), each once complete (its blank line): its text
    and its id together, so a break inside an event neither keeps half of it nor loses it on a resume."""
    event_id: str | None = None
    data: list[bytes] = []
    async for raw in content:
        line = raw.strip()
        if line.startswith(b"id:"):
            event_id = line[3:].strip().decode()
        elif line.startswith(b"data:"):
            data.append(line[5:].strip())
        elif not line and data:
            yield event_id, data
            event_id, data = None, []


def _take(obj: dict[str, object], r: RequestResult, parts: list[str]) -> str:
    r.rid = r.rid or str(obj.get("id", ""))
    err = obj.get("error")
    if isinstance(err, dict):
        r.error = str(err.get("message", "error"))
        return "error"
    choices = obj.get("choices")
    for ch in choices if isinstance(choices, list) else []:
        if ch.get("text"):
            parts.append(ch["text"])
            r.chunk_times.append(time.monotonic())
        if ch.get("finish_reason"):
            r.finish_reason = ch["finish_reason"]
    usage = obj.get("usage")
    if isinstance(usage, dict):
        r.completion_tokens = int(usage["completion_tokens"])
    return "ok"
