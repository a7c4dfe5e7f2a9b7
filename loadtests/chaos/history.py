"""A recording streaming client: every request's history for the checker (loadtests/chaos/checker.py).

Each SSE event the client takes is recorded with its receive time, the gateway it came through, its
text, and its decoded stream position (`id:`; gateway/protocol/streamid.py): the output ids the
client has after it, and the worker and incarnation serving the choice. A stream that breaks (an
error, no [DONE], or silence past `read_timeout_s`: a partitioned gateway sends nothing and resets
nothing) is re-sent to the next gateway with `Last-Event-ID`; one that broke before its first event
is re-sent without it (nothing was received, so nothing can be repeated). Positions are verified
with the cluster's stream key: a forged id would be a finding, not data.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from gateway.protocol.streamid import RESUMABLE_HEADERS, StreamIdError, StreamPosition, read_position
from loadtests.client import sse_events


def decode_position(key: bytes, text: str) -> StreamPosition | None:
    """The position an event id holds, if it verifies under the cluster's stream `key`; else None."""
    try:
        return read_position(key, text)
    except StreamIdError:
        return None


def new_history(
    idx: int, prompt: list[int], max_tokens: int, temperature: float, seed: int | None
) -> dict[str, Any]:
    return {
        "idx": idx,
        "prompt_ids": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "seed": seed,
        "sent_at": None,
        "ended_at": None,
        "events": [],  # [t, gateway, text, sent, worker, epoch, done, id_ok]
        "attempts": [],  # {t, gateway, resumed, status, end, error}
        "status": 0,
        "error": None,
        "finish_reason": None,
        "rid": "",
    }


async def run_request(
    http: aiohttp.ClientSession,
    urls: Sequence[str],
    first: int,
    h: dict[str, Any],
    key: bytes,
    *,
    model: str,
    api_key: str | None = None,
    read_timeout_s: float = 5.0,
    max_attempts: int = 8,
    t0: float = 0.0,
) -> dict[str, Any]:
    """Stream `h`'s request, starting on gateway `first`, moving round robin on each break."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": h["prompt_ids"],
        "max_tokens": h["max_tokens"],
        "temperature": h["temperature"],
        "stream": True,
        "ignore_eos": True,
    }
    if h["seed"] is not None:
        body["seed"] = h["seed"]
    # a resumable stream, asked for (`id:` lines; Last-Event-ID)
    auth = dict(RESUMABLE_HEADERS, **({"Authorization": f"Bearer {api_key}"} if api_key else {}))
    at: list[str] = []  # the last complete event's id, kept across a break (an exception included)
    h["sent_at"] = time.monotonic() - t0
    for attempt in range(max_attempts):
        g = (first + attempt) % len(urls)
        headers = dict(auth, **({"Last-Event-ID": at[-1]} if at else {}))
        rec: dict[str, Any] = {"t": round(time.monotonic() - t0, 4), "gateway": g, "resumed": bool(at)}
        h["attempts"].append(rec)
        h["error"] = None
        try:
            end = await _read(http, urls[g], g, body, headers, h, rec, key, read_timeout_s, t0, at)
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            end = "broken"
            h["error"] = f"{type(exc).__name__}: {exc}"
        rec["end"], rec["error"] = end, h["error"]
        if end != "broken":
            break
        await asyncio.sleep(0.05 * attempt)  # a gateway being restarted answers refused at once
    if h["finish_reason"] is None and h["error"] is None:
        h["error"] = "stream truncated"
    h["ended_at"] = time.monotonic() - t0
    return h


async def _read(
    http: aiohttp.ClientSession,
    url: str,
    g: int,
    body: dict[str, Any],
    headers: dict[str, str],
    h: dict[str, Any],
    rec: dict[str, Any],
    key: bytes,
    read_timeout_s: float,
    t0: float,
    at: list[str],
) -> str:
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=read_timeout_s, sock_read=read_timeout_s)
    async with http.post(f"{url}/v1/completions", json=body, headers=headers, timeout=timeout) as resp:
        h["status"] = rec["status"] = resp.status
        if resp.status != 200:
            h["error"] = (await resp.text())[:300]
            return "broken" if resp.status >= 502 else "error"
        async for event_id, data in sse_events(resp.content):
            for payload in data:
                if payload == b"[DONE]":
                    return "done"
                obj = json.loads(payload)
                h["rid"] = h["rid"] or str(obj.get("id", ""))
                err = obj.get("error")
                if isinstance(err, dict):
                    h["error"] = str(err.get("message", "error"))
                    return "error"
                _record(obj, event_id, g, h, key, t0)
            if event_id is not None:
                at.append(event_id)
    return "broken"


def _record(
    obj: dict[str, Any], event_id: str | None, g: int, h: dict[str, Any], key: bytes, t0: float
) -> None:
    text = ""
    for ch in obj.get("choices") or []:
        text += ch.get("text") or ""
        if ch.get("finish_reason"):
            h["finish_reason"] = ch["finish_reason"]
    pos = decode_position(key, event_id) if event_id else None
    c = pos.choices[0] if pos is not None and pos.choices else None
    h["events"].append(
        [
            round(time.monotonic() - t0, 4),
            g,
            text,
            c.sent if c else None,
            c.worker if c else None,
            c.epoch if c else None,
            bool(c.done) if c else False,
            pos is not None or event_id is None,
        ]
    )
