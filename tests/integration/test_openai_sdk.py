"""The official `openai` client against an in-process gateway: n choices, logprobs / top_logprobs
(completions and chat, streamed and not), stop strings across chunk boundaries, usage with cached
tokens, and resumed streams that keep every token and every logprob — over Lumen's synthetic workers
and over SGLang stand-ins (tests/fixtures/sglang_standin.py, which report logprobs as SGLang does).

Ground truth is the models themselves: models/synthetic.py for Lumen's workers, the stand-in's
pseudo-model for SGLang, each asked for the ids and logprobs of every position.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

openai = pytest.importorskip("openai")

from gateway.config import load_config  # noqa: E402
from gateway.protocol import bytevocab  # noqa: E402
from gateway.protocol.generate import SamplingParams  # noqa: E402
from gateway.protocol.launch import EngineSpec  # noqa: E402
from gateway.protocol.openai.chat import render_default  # noqa: E402
from gateway.protocol.sglang import sglang_seed  # noqa: E402
from gateway.server.app import Gateway  # noqa: E402
from models.synthetic import Sampler, SyntheticModel, expected_output  # noqa: E402
from tests.fixtures.sglang_standin import SGLangStandIn, start_standin  # noqa: E402
from tests.fixtures.sglang_standin_model import (  # noqa: E402
    Sampling,
    chain,
    choose,
    context_state,
    distribution,
)
from worker_hooks.engine.service import Worker, start_worker  # noqa: E402

MODEL = "lumen-synthetic"
EOS = bytevocab.EOS_ID
PROMPT = "The quick brown fox jumps over the lazy dog"
MESSAGES = [{"role": "user", "content": "Tell me about foxes."}]
SEED = 4242

# (temperature, seed) of each sampling mode
MODES = {"greedy": (0.0, None), "seeded": (0.8, SEED)}


# -- clusters ----------------------------------------------------------------------------------------------


def sdk(gw: Gateway) -> Any:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gw.http_port}/v1", api_key="unused", max_retries=0)


async def until(cond: Callable[[], bool], limit_s: float = 10.0) -> None:
    """Poll cluster state that has no event of its own (worker attachment) until it holds."""
    async with asyncio.timeout(limit_s):
        while not cond():
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def lumen_cluster(n: int = 2, **overrides: Any) -> AsyncIterator[tuple[Gateway, list[Worker], Any]]:
    cfg = load_config(
        overrides={
            "gateway.port": 0,
            "gateway.control_port": 0,
            "timeouts.control_stop_grace_s": 0.05,  # stop() cancels the workers' streams at once
            "recovery.mode": "stop_restart",
            "health.heartbeat_interval_ms": 50,
            "health.heartbeat_misses": 6,
            **overrides,
        }
    )
    gw = Gateway(cfg)
    await gw.start()
    try:
        async with contextlib.AsyncExitStack() as stack:
            workers = []
            for i in range(n):
                spec = EngineSpec(
                    worker_id=f"w{i}",
                    control_address=f"127.0.0.1:{gw.control_port}",
                    control_token=gw.config.gateway.control_token,
                    model="Qwen3-0.6B",
                    time_scale=0.2,
                    heartbeat_interval_ms=50,
                )
                workers.append(await stack.enter_async_context(start_worker(spec)))
            await until(lambda: gw.monitor.healthy_count() == n)
            client = sdk(gw)
            try:
                yield gw, workers, client
            finally:
                await client.close()
    finally:
        await gw.stop()


@contextlib.asynccontextmanager
async def sglang_cluster(n: int = 2) -> AsyncIterator[tuple[Gateway, list[SGLangStandIn], Any]]:
    # one server streams SGLang's default (cumulative ids and logprob rows), the other incrementally
    servers = [
        await start_standin(incremental_streaming_output=(i % 2 == 1), token_delay_ms=4) for i in range(n)
    ]
    cfg = load_config(
        overrides={
            "gateway.port": 0,
            "gateway.control_port": 0,
            "timeouts.control_stop_grace_s": 0.05,  # stop() cancels the workers' streams at once
            "recovery.mode": "stop_restart",
            "sglang.poll_interval_ms": 50,
            "sglang.workers": [{"url": s.url, "id": f"sg{i}"} for i, s in enumerate(servers)],
        }
    )
    gw = Gateway(cfg)
    await gw.start()
    try:
        await until(lambda: gw.monitor.healthy_count() == n)
        client = sdk(gw)
        try:
            yield gw, servers, client
        finally:
            await client.close()
    finally:
        await gw.stop()
        for s in servers:
            await s.stop()


# -- ground truth ------------------------------------------------------------------------------------------

Row = tuple[int, float, list[tuple[int, float]]]  # (id, logprob, top (id, logprob) most likely first)


def synthetic_truth(prompt: list[int], max_tokens: int, mode: str, choice: int, top_n: int) -> list[Row]:
    """What a Lumen synthetic worker emits for choice `choice` (seed + choice), with logprobs."""
    temperature, seed = MODES[mode]
    sp = SamplingParams(max_new_tokens=max_tokens, temperature=temperature, stop_token_ids=[EOS])
    seed_base = 0 if seed is None else seed + choice
    ids, _ = expected_output(prompt, sp, seed_base)
    model = SyntheticModel(0, 32, 127)
    sampler = Sampler.from_params(sp, seed_base)
    h = model.absorb(model.initial_state(), prompt)
    rows: list[Row] = []
    for t in ids:
        lp = model.token_logprob(h, t, sampler, top_n)
        assert lp.logprob is not None
        rows.append((t, lp.logprob, [(i, v) for v, i in lp.top if v is not None]))
        h = model.advance(h, t)
    return rows


def standin_truth(prompt: list[int], max_tokens: int, mode: str, choice: int, top_n: int) -> list[Row]:
    """What a stand-in SGLang server emits (the gateway sends seed + choice as sampling_seed)."""
    temperature, seed = MODES[mode]
    sp = Sampling(temperature=temperature, seed=None if seed is None else sglang_seed(seed + choice))
    t_lp = 1.0 if sp.greedy else temperature  # SGLang's logprobs: the model's for greedy requests
    state = context_state(prompt)
    rows: list[Row] = []
    for k in range(max_tokens):
        dist = distribution(state)
        token = choose(dist, sp, state, len(prompt) + k)
        top = [(i, v) for v, i in dist.top(top_n, t_lp)]
        rows.append((token, dist.logprob(token, t_lp), top))
        state = chain(state, token)
    return rows


def text_of(rows: list[Row]) -> str:
    return bytes(t for t, _, _ in rows if t < 256).decode()


def chat_prompt() -> list[int]:
    return bytevocab.encode(render_default((m["role"], m["content"]) for m in MESSAGES))


# -- what the client got -----------------------------------------------------------------------------------


@dataclass
class Choice:
    text: str = ""
    tokens: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[dict[str, float]] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    finish: str | None = None

    def add_completion(self, text: str, lp: Any, finish: str | None) -> None:
        self.text += text
        if lp is not None:
            self.tokens += lp.tokens
            self.logprobs += lp.token_logprobs
            self.tops += lp.top_logprobs
            self.offsets += lp.text_offset
        self.finish = finish or self.finish

    def add_chat(self, text: str | None, lp: Any, finish: str | None) -> None:
        self.text += text or ""
        for c in lp.content if lp is not None and lp.content else []:
            assert bytes(c.bytes).decode("utf-8", errors="replace") == c.token
            self.tokens.append(c.token)
            self.logprobs.append(c.logprob)
            self.tops.append({t.token: t.logprob for t in c.top_logprobs})
        self.finish = finish or self.finish


def want_completion(rows: list[Row]) -> tuple[list[str], list[float], list[dict[str, float]]]:
    return (
        [chr(t) for t, _, _ in rows],
        [v for _, v, _ in rows],
        [{chr(i): v for i, v in top} for _, _, top in rows],
    )


def check(choice: Choice, rows: list[Row], finish: str = "length") -> None:
    assert choice.text == text_of(rows)
    assert (choice.tokens, choice.logprobs, choice.tops) == want_completion(rows)
    assert choice.finish == finish


async def completion(client: Any, stream: bool, **kw: Any) -> tuple[dict[int, Choice], Any, str]:
    """(choices by index, usage, response id) of one completion, streamed or not."""
    got: dict[int, Choice] = {}
    if not stream:
        resp = await client.completions.create(model=MODEL, **kw)
        for c in resp.choices:
            got.setdefault(c.index, Choice()).add_completion(c.text, c.logprobs, c.finish_reason)
        return got, resp.usage, resp.id
    usage, rid = None, ""
    s = await client.completions.create(
        model=MODEL, stream=True, stream_options={"include_usage": True}, **kw
    )
    async for chunk in s:
        rid = chunk.id
        usage = chunk.usage or usage
        for c in chunk.choices:
            got.setdefault(c.index, Choice()).add_completion(c.text, c.logprobs, c.finish_reason)
    return got, usage, rid


async def chat(client: Any, stream: bool, **kw: Any) -> tuple[dict[int, Choice], Any]:
    got: dict[int, Choice] = {}
    if not stream:
        resp = await client.chat.completions.create(model=MODEL, messages=MESSAGES, **kw)
        for c in resp.choices:
            got.setdefault(c.index, Choice()).add_chat(c.message.content, c.logprobs, c.finish_reason)
        return got, resp.usage
    usage = None
    s = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **kw
    )
    async for chunk in s:
        usage = chunk.usage or usage
        for c in chunk.choices:
            got.setdefault(c.index, Choice()).add_chat(c.delta.content, c.logprobs, c.finish_reason)
    return got, usage


# -- Lumen's synthetic workers -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_completions_n_logprobs_and_usage(mode: str) -> None:
    temperature, seed = MODES[mode]
    prompt = list(PROMPT.encode())
    async with lumen_cluster() as (_gw, _ws, client):
        for stream in (False, True):
            kw = {"prompt": PROMPT, "max_tokens": 24, "n": 2, "temperature": temperature, "logprobs": 3}
            got, usage, _ = await completion(client, stream, seed=seed, **kw)
            assert sorted(got) == [0, 1]
            for i in (0, 1):
                rows = synthetic_truth(prompt, 24, mode, i, 3)
                check(got[i], rows)
                # text offsets count the token strings from the choice's start
                assert got[i].offsets == list(range(24))
            if mode == "seeded":
                assert got[0].text != got[1].text  # each choice has its own seed
            assert usage.prompt_tokens == len(prompt) and usage.completion_tokens == 48
            assert usage.total_tokens == len(prompt) + 48
            assert usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_n_logprobs_top_logprobs(stream: bool) -> None:
    async with lumen_cluster() as (_gw, _ws, client):
        got, usage = await chat(
            client, stream, max_tokens=16, n=3, temperature=0.8, seed=SEED, logprobs=True, top_logprobs=5
        )
        assert sorted(got) == [0, 1, 2]
        for i in range(3):
            rows = synthetic_truth(chat_prompt(), 16, "seeded", i, 5)
            check(got[i], rows)
        assert usage.prompt_tokens == len(chat_prompt()) and usage.completion_tokens == 48
        plain, _ = await chat(client, stream, max_tokens=4, temperature=0.0)
        assert plain[0].tokens == [] and len(plain[0].text) == 4  # no logprobs unless asked for


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_string_spanning_worker_chunks(stream: bool) -> None:
    """A Lumen worker sends one chunk per token, so a 3-character stop string spans three chunks:
    the text ends before it, the finish reason is "stop", logprobs cover every token counted."""
    prompt = list(PROMPT.encode())
    rows = synthetic_truth(prompt, 40, "greedy", 0, 0)
    text = text_of(rows)
    at = next(k for k in range(8, 30) if text.find(text[k : k + 3]) == k)
    stop = text[at : at + 3]
    async with lumen_cluster(1) as (_gw, _ws, client):
        kw = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0.0, "stop": [stop, "\x00never"]}
        got, usage, _ = await completion(client, stream, logprobs=0, **kw)
        assert got[0].text == text[:at] and got[0].finish == "stop"
        assert len(got[0].tokens) == usage.completion_tokens >= at + 3
        assert "".join(got[0].tokens) == text[: usage.completion_tokens]
        assert got[0].tops == [{}] * usage.completion_tokens  # logprobs = 0: no alternatives
        chat_text = text_of(synthetic_truth(chat_prompt(), 40, "greedy", 0, 0))
        at = next(k for k in range(8, 30) if chat_text.find(chat_text[k : k + 2]) == k)
        chat_got, _ = await chat(client, stream, max_tokens=40, temperature=0.0, stop=chat_text[at : at + 2])
        assert chat_got[0].text == chat_text[:at] and chat_got[0].finish == "stop"


@pytest.mark.parametrize("mode", MODES)
async def test_resumed_stream_keeps_tokens_and_logprobs(mode: str) -> None:
    """n = 2, streamed with logprobs; the worker serving choice 0 stops mid-stream. Both choices end
    with exactly a run without the failure's tokens and logprobs, and usage is unchanged."""
    temperature, seed = MODES[mode]
    kw = {
        "prompt": PROMPT,
        "max_tokens": 120,
        "n": 2,
        "temperature": temperature,
        "seed": seed,
        "logprobs": 2,
    }
    prompt = list(PROMPT.encode())
    async with lumen_cluster(3) as (gw, ws, client):
        clean, clean_usage, _ = await completion(client, True, **kw)
        for i in (0, 1):
            check(clean[i], synthetic_truth(prompt, 120, mode, i, 2))

        got: dict[int, Choice] = {}
        usage: Any = None
        victim: str | None = None
        s = await client.completions.create(
            model=MODEL, stream=True, stream_options={"include_usage": True}, **kw
        )
        async for chunk in s:
            usage = chunk.usage or usage
            for c in chunk.choices:
                got.setdefault(c.index, Choice()).add_completion(c.text, c.logprobs, c.finish_reason)
            if victim is None and len(got.get(0, Choice()).tokens) >= 10:
                assert gw.sessions is not None
                victim = gw.sessions.live[f"{chunk.id}-0"].worker_id
                await next(w for w in ws if w.worker_id == victim).engine.stop()
        assert victim is not None
        for i in (0, 1):
            assert got[i] == clean[i]
        assert usage == clean_usage
        assert gw.sessions is not None
        interrupted = [s for s in gw.sessions.recent_interrupted if s.interruptions]
        assert any(s.job.rid.endswith("-0") for s in interrupted)
        assert all(
            it.worker_id == victim and it.resumed_on != victim for s in interrupted for it in s.interruptions
        )


# -- SGLang (stand-ins) ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_sglang_n_logprobs_both_streaming_forms(mode: str) -> None:
    """Each server of the pair streams in one of SGLang's two forms (cumulative ids and logprob rows,
    or incremental); with n = 4 both serve choices, and every choice reads the same."""
    temperature, seed = MODES[mode]
    prompt = list(PROMPT.encode())
    async with sglang_cluster() as (_gw, servers, client):
        for stream in (False, True):
            kw = {"prompt": PROMPT, "max_tokens": 20, "n": 4, "temperature": temperature, "logprobs": 4}
            got, usage, _ = await completion(client, stream, seed=seed, **kw)
            for i in range(4):
                check(got[i], standin_truth(prompt, 20, mode, i, 4))
            assert usage.completion_tokens == 80
        got_chat, _ = await chat(
            client, True, max_tokens=12, temperature=temperature, seed=seed, logprobs=True, top_logprobs=3
        )
        check(got_chat[0], standin_truth(chat_prompt(), 12, mode, 0, 3))
        assert all(s.stats()["refused"] == [] for s in servers)  # SGLang's contract took every body
        assert all(s.stats()["requests"] > 0 for s in servers)


async def test_sglang_cached_tokens_in_usage() -> None:
    """`meta_info.cached_tokens` from the server becomes `prompt_tokens_details.cached_tokens`, the
    first choice's when n > 1 (as SGLang's own OpenAI layer counts it)."""
    prompt = "A long shared prefix, " * 8  # 176 tokens: two full pages of 64 in the radix cache
    async with sglang_cluster(1) as (_gw, _servers, client):
        _, usage0, _ = await completion(client, False, prompt=prompt, max_tokens=4, temperature=0.0)
        assert usage0.prompt_tokens == len(prompt) and usage0.prompt_tokens_details.cached_tokens == 0
        _, usage1, _ = await completion(client, False, prompt=prompt, max_tokens=4, temperature=0.0)
        assert usage1.prompt_tokens_details.cached_tokens == (len(prompt) - 1) // 64 * 64
        _, usage2, _ = await completion(client, True, prompt=prompt, max_tokens=4, n=3, temperature=0.0)
        assert usage2.prompt_tokens == len(prompt) and usage2.completion_tokens == 12
        assert usage2.prompt_tokens_details.cached_tokens == (len(prompt) - 1) // 64 * 64


@pytest.mark.parametrize("mode", MODES)
async def test_sglang_resumed_stream_keeps_logprobs(mode: str) -> None:
    temperature, seed = MODES[mode]
    prompt = list(PROMPT.encode())
    kw = {"prompt": PROMPT, "max_tokens": 80, "n": 2, "temperature": temperature, "seed": seed, "logprobs": 2}
    async with sglang_cluster(3) as (gw, servers, client):
        got: dict[int, Choice] = {}
        killed: SGLangStandIn | None = None
        s = await client.completions.create(model=MODEL, stream=True, **kw)
        async for chunk in s:
            for c in chunk.choices:
                got.setdefault(c.index, Choice()).add_completion(c.text, c.logprobs, c.finish_reason)
            if killed is None and len(got.get(1, Choice()).tokens) >= 10:
                assert gw.sessions is not None
                wid = gw.sessions.live[f"{chunk.id}-1"].worker_id
                killed = next(srv for srv in servers if srv.url == gw.monitor.workers[wid].http_url)
                await killed.kill()
        assert killed is not None
        for i in (0, 1):
            check(got[i], standin_truth(prompt, 80, mode, i, 2))
        assert gw.sessions is not None and any(x.interruptions for x in gw.sessions.recent_interrupted)
