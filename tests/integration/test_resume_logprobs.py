"""A resumed stream with logprobs: the client gets every token's logprob exactly once (issue 28).

Under a byte-level BPE tokenizer many steps hold their text back (a byte that ends no character), and
their logprobs wait for the next chunk that carries text. A stream broken and resumed from its last
event id must neither drop the logprobs of tokens whose text was held back at the break nor send
again those the client already has, whatever the chunking of the resumed (replayed or adopted)
attempt. Before the fix both happened: a chat choice's held tokens were covered by an id the other
choice's event carried and their logprobs were then dropped by the replay, and a replay that ended on
a held token sent its logprob a second time."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp

from tests.integration.test_gateway_inprocess import cluster
from tests.integration.test_resume_stream import byte_level_bpe, events, last_id

Events = list[tuple[str | None, str]]


def logprob_tokens(evs: Events, chat: bool) -> dict[int, list[tuple[str, float]]]:
    """Per choice, the (token, logprob) entries the client received, in order."""
    out: dict[int, list[tuple[str, float]]] = {}
    for _, data in evs:
        if data == "[DONE]":
            continue
        for ch in json.loads(data).get("choices", []):
            lp = ch.get("logprobs")
            got = out.setdefault(ch["index"], [])
            if lp is None:
                continue
            if chat:
                got += [(c["token"], c["logprob"]) for c in lp["content"]]
            else:
                got += list(zip(lp["tokens"], lp["token_logprobs"], strict=True))
    return out


def offsets(evs: Events) -> list[int]:
    return [
        o
        for _, d in evs
        if d != "[DONE]"
        for ch in json.loads(d)["choices"]
        for o in ch["logprobs"]["text_offset"]
        if ch.get("logprobs")
    ]


async def resumed(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], limit: int
) -> tuple[Events, Events]:
    async with http.post(url, json=body) as resp:
        first = await events(resp, limit=limit)
    if all(i is None for i, _ in first):  # broken before the first id (a chat role chunk): a new request
        return first, []
    # what the client's Last-Event-ID says it has: the events up to the last with an id (an event
    # after it belongs to a step whose id it had not read yet, and comes again; resume.py)
    first = first[: max(k for k, (i, _) in enumerate(first) if i is not None) + 1]
    async with http.post(url, json=body, headers={"Last-Event-ID": last_id(first)}) as resp:
        assert resp.status == 200, await resp.text()
        rest = await events(resp)
    return first, rest


async def test_logprobs_of_held_back_tokens_survive_a_resume(tmp_path: Path) -> None:
    path, vocab = byte_level_bpe(tmp_path)
    worker = {"token_lo": 0, "token_hi": 256, "vocab_size": vocab}
    tokenizer = {"tokenizer.kind": "hf", "tokenizer.path": str(path)}
    cases: list[tuple[str, dict[str, Any], bool]] = [
        ("/v1/completions", {"prompt": "Resume me", "logprobs": 2}, False),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True}, True),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "y"}], "logprobs": True, "n": 2, "seed": 5},
            True,
        ),
    ]
    wrong: list[str] = []
    async with cluster(worker=worker, **tokenizer) as (_gw, _workers, http):
        for url, extra, chat in cases:
            body = {"max_tokens": 30, "temperature": 0.0, "stream": True, **extra}
            if "seed" in extra:
                body["temperature"] = 0.8
            async with http.post(url, json=body) as resp:
                whole = await events(resp)
            want = logprob_tokens(whole, chat)
            assert all(len(v) == 30 for v in want.values())
            for limit in range(1, 24):
                first, rest = await resumed(http, url, body, limit)
                if not rest:
                    continue
                a, b = logprob_tokens(first, chat), logprob_tokens(rest, chat)
                got = {i: a.get(i, []) + b.get(i, []) for i in want}
                if got != want:
                    wrong.append(
                        f"{url} n={extra.get('n', 1)} break after {limit} events: {[len(v) for v in got.values()]} entries"
                    )
                if not chat and offsets(first) + offsets(rest) != offsets(whole):
                    wrong.append(f"{url} break after {limit} events: text_offset differs")
    assert not wrong, "\n".join(wrong)
