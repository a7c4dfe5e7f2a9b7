"""Log probabilities from Lumen's worker (`return_logprob`, `top_logprobs_num` on /generate): SGLang's
row shapes, the model's numbers, and the same numbers for every position however a request is split
across attempts (a replay sends `prompt + emitted`) — synthetic backend over HTTP, torch in process."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest

from gateway.protocol.generate import GenerateChunk, GenerateRequest, LumenExt, SamplingParams, decode_chunk
from gateway.protocol.launch import EngineSpec
from models.synthetic import Sampler, SyntheticModel
from worker_hooks.engine.service import Worker, start_worker

FAST = {"model": "Qwen3-0.6B", "gpu": "H100-80G", "time_scale": 0.01}
PROMPT = list(b"log probabilities, please")
SAMPLINGS = {
    "greedy": ({"temperature": 0.0}, 0),
    "seeded": ({"temperature": 0.7, "top_p": 0.9, "top_k": 6}, 77),
}


@pytest.fixture
async def worker() -> AsyncIterator[Worker]:
    async with start_worker(EngineSpec(worker_id="w-lp", control_address="", **FAST)) as w:
        yield w


async def generate(
    w: Worker, prompt: list[int], params: dict[str, Any], seed: int, top: int
) -> list[GenerateChunk]:
    body = {"input_ids": prompt, "sampling_params": params, "stream": True, "return_logprob": True,
            "top_logprobs_num": top, "lumen": {"seed_base": seed}}  # fmt: skip
    chunks = []
    async with aiohttp.ClientSession() as cs, cs.post(w.url + "/generate", json=body) as r:
        assert r.status == 200
        async for line in r.content:
            payload = line.removeprefix(b"data: ").strip()
            if payload and payload != b"[DONE]":
                chunks.append(decode_chunk(payload))
    return chunks


def rows(chunks: list[GenerateChunk]) -> tuple[list[int], list[Any], list[Any]]:
    ids = [i for c in chunks for i in c.output_ids]
    lps = [r for c in chunks for r in c.meta_info.output_token_logprobs]
    tops = [t for c in chunks for t in c.meta_info.output_top_logprobs]
    return ids, lps, tops


@pytest.mark.parametrize("sampling", SAMPLINGS)
async def test_synthetic_logprobs_are_the_models_and_survive_a_replay(worker: Worker, sampling: str) -> None:
    extra, seed = SAMPLINGS[sampling]
    params = {"max_new_tokens": 16, "ignore_eos": True, **extra}
    chunks = await generate(worker, PROMPT, params, seed, 3)
    ids, lps, tops = rows(chunks)
    assert len(ids) == len(lps) == len(tops) == 16
    assert all(len(c.output_ids) == len(c.meta_info.output_token_logprobs) for c in chunks)  # incremental
    # the model's distribution at each position: temperature-scaled unless greedy (SGLang's default)
    model = SyntheticModel(0, 32, 127)
    sampler = Sampler.from_params(SamplingParams(**params), seed)
    h = model.absorb(model.initial_state(), PROMPT)
    for k, token in enumerate(ids):
        want = model.token_logprob(h, token, sampler, 3)
        assert lps[k] == (want.logprob, token, None)
        assert tops[k] == [(v, i, None) for v, i in want.top]
        assert [v for v, _, _ in tops[k]] == sorted((v for v, _, _ in tops[k]), reverse=True)
        h = model.advance(h, token)
    if sampling == "greedy":  # the chosen token is the most likely one whenever no two candidates share it
        assert sum(1 for k in range(16) if tops[k][0][1] == ids[k]) >= 12
    # a replay of prompt + the first 5 ids reports the same numbers for the rest
    replay = await generate(worker, PROMPT + ids[:5], params | {"max_new_tokens": 11}, seed, 3)
    r_ids, r_lps, r_tops = rows(replay)
    assert (r_ids, r_lps, r_tops) == (ids[5:], lps[5:], tops[5:])


async def test_logprobs_off_and_top_zero(worker: Worker) -> None:
    params = {"max_new_tokens": 4, "temperature": 0.0}
    body = {"input_ids": PROMPT, "sampling_params": params, "stream": False}
    async with aiohttp.ClientSession() as cs:
        async with cs.post(worker.url + "/generate", json=body) as r:
            plain = (await r.json())["meta_info"]
        async with cs.post(worker.url + "/generate", json=body | {"return_logprob": True}) as r:
            only = (await r.json())["meta_info"]
        async with cs.post(worker.url + "/generate", json=body | {"top_logprobs_num": -1}) as r:
            assert r.status == 400
    assert "output_token_logprobs" not in plain and "output_top_logprobs" not in plain
    assert len(only["output_token_logprobs"]) == 4 and "output_top_logprobs" not in only
    assert all(math.exp(row[0]) <= 1.0 for row in only["output_token_logprobs"])


# -- torch ------------------------------------------------------------------------------------------------


async def test_torch_logprobs_match_a_replay() -> None:
    """Real logits: sorted top rows, the argmax on top for greedy, and a replay of prompt + 4 ids reports
    the same ids and (to float rounding: a prefill and a decode step sum differently) the same numbers."""
    pytest.importorskip("torch")
    spec = EngineSpec(worker_id="w-tlp", control_address="", backend="torch", torch_model="tiny",
                      model="Qwen3-8B", page_size=8, kv_capacity_tokens=2048, torch_threads=1,
                      log_level="warning")  # fmt: skip
    prompt = [(i * 37) % 256 for i in range(20)]
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_new_tokens=10, temperature=0.8, top_k=50, ignore_eos=True)
    async with start_worker(spec) as w:
        for name, params, seed in (("g", greedy, 0), ("s", seeded, 9)):
            got = await _torch_run(w, f"{name}-1", prompt, params, seed)
            ids = [t.token_id for t in got]
            for t in got:
                assert t.logprob is not None and t.logprob <= 0.0 and len(t.top) == 4
                assert [v for v, _ in t.top] == sorted((v for v, _ in t.top), reverse=True)
                assert t.top[0][0] >= t.logprob
            if name == "g":
                assert all(t.top[0][1] == t.token_id for t in got)  # greedy: the argmax
            rest = msgspec.structs.replace(params, max_new_tokens=6)
            replay = await _torch_run(w, f"{name}-2", prompt + ids[:4], rest, seed)
            assert [t.token_id for t in replay] == ids[4:]
            for a, b in zip(got[4:], replay, strict=True):
                assert b.logprob == pytest.approx(a.logprob, abs=1e-4)
                assert [i for _, i in b.top] == [i for _, i in a.top]
                assert [v for v, _ in b.top] == pytest.approx([v for v, _ in a.top], abs=1e-4)


async def _torch_run(w: Worker, rid: str, prompt: list[int], params: SamplingParams, seed: int) -> list[Any]:
    req = GenerateRequest(rid=rid, input_ids=prompt, sampling_params=params, return_logprob=True,
                          top_logprobs_num=4, lumen=LumenExt(seed_base=seed))  # fmt: skip
    handle = w.engine.submit(req)
    out = []
    while True:
        e = await handle.next()
        assert len(e.logprobs) == len(e.new_ids)
        out.extend(e.logprobs)
        if e.finish is not None:
            return out
