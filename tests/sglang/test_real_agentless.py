"""The gateway agentless in front of two real SGLang servers (sglang 0.5.23 on CPU, a tiny float32
Qwen3): every API form a client uses answers as SGLang itself does, and a server killed -9 mid-stream
leaves every greedy stream with exactly the ids of a run without the kill."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from gateway.config import load_config
from gateway.core.health import WorkerState
from gateway.server.app import Gateway
from tests.sglang.real import MODEL_NAME, ServerPool, SGLangServer, stream_generate, tiny_models

pytestmark = pytest.mark.timeout(600)

PROMPTS = [f"Request {i}: tell me about the sea and the lighthouse keeper." for i in range(8)]
MAX_NEW = 200


def gateway_config(servers: list[SGLangServer], **overrides: Any) -> Any:
    target = tiny_models()["target"]
    return load_config(
        overrides={
            "gateway.port": 0,
            "gateway.control_port": 0,
            "timeouts.control_stop_grace_s": 0.05,
            "recovery.mode": "stop_restart",
            "sglang.workers": [{"url": s.url, "id": f"sg{i}"} for i, s in enumerate(servers)],
            "tokenizer.kind": "hf",
            "tokenizer.path": str(target / "tokenizer.json"),
            "tokenizer.chat_template": str(target / "chat_template.jinja"),
            "gateway.served_model_name": MODEL_NAME,
            **overrides,
        }
    )


@contextlib.asynccontextmanager
async def gateway_over(servers: list[SGLangServer]) -> AsyncIterator[tuple[Gateway, aiohttp.ClientSession]]:
    gw = Gateway(gateway_config(servers))
    await gw.start()
    try:
        async with aiohttp.ClientSession(
            f"http://127.0.0.1:{gw.http_port}", timeout=aiohttp.ClientTimeout(total=120)
        ) as http:
            async with asyncio.timeout(30):
                while gw.monitor.healthy_count() < len(servers):
                    await asyncio.sleep(0.02)
            yield gw, http
    finally:
        await gw.stop()


def greedy(text: str, max_new: int = MAX_NEW, **extra: Any) -> dict[str, Any]:
    return {"text": text, "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0}, **extra}


async def direct(server: SGLangServer, body: dict[str, Any]) -> Any:
    return await asyncio.to_thread(server.generate, body)


@pytest.fixture
def two(real_servers: ServerPool) -> list[SGLangServer]:
    return real_servers.live(2)


async def test_generate_and_openai_forms_answer_as_sglang_does(two: list[SGLangServer]) -> None:
    ref = await direct(two[0], greedy(PROMPTS[0], 24))
    async with gateway_over(two) as (_gw, http):
        async with http.post("/generate", json=greedy(PROMPTS[0], 24)) as resp:
            got = await resp.json()
        assert got["output_ids"] == ref["output_ids"] and got["text"] == ref["text"]
        seen: list[int] = []
        assert await stream_generate(http, greedy(PROMPTS[0], 24), seen) == ref["output_ids"]
        # OpenAI completions: the same text, and logprobs of every token
        body = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0, "logprobs": 2}
        async with http.post("/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            comp = await resp.json()
        choice = comp["choices"][0]
        assert choice["text"] == ref["text"]
        assert len(choice["logprobs"]["token_logprobs"]) == 24
        assert all(len(t) <= 2 for t in choice["logprobs"]["top_logprobs"])
        # chat, n = 2 greedy choices: both the same continuation
        chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16,
                "temperature": 0, "n": 2}  # fmt: skip
        async with http.post("/v1/chat/completions", json=chat) as resp:
            assert resp.status == 200, await resp.text()
            out = await resp.json()
        texts = [c["message"]["content"] for c in out["choices"]]
        assert len(texts) == 2 and texts[0] == texts[1] and out["usage"]["completion_tokens"] == 32


@pytest.mark.parametrize("form", ["cumulative", "incremental"])
async def test_a_server_killed_mid_stream_leaves_every_greedy_stream_exact(
    real_servers: ServerPool, form: str
) -> None:
    """Both of SGLang's streaming forms: cumulative `output_ids` in every chunk (its default) and
    `--incremental-streaming-output`; the gateway resumes either."""
    two = real_servers.live(2, *(["--incremental-streaming-output"] if form == "incremental" else []))
    refs = await asyncio.gather(*(direct(two[i % 2], greedy(p)) for i, p in enumerate(PROMPTS)))
    async with gateway_over(two) as (gw, http):
        seen: list[list[int]] = [[] for _ in PROMPTS]
        tasks = [
            asyncio.create_task(stream_generate(http, greedy(p), s))
            for p, s in zip(PROMPTS, seen, strict=True)
        ]
        async with asyncio.timeout(60):
            while not all(len(s) >= 16 for s in seen):
                await asyncio.sleep(0.01)
        victim = two[0]
        victim.kill()
        got = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        for ref, ids in zip(refs, got, strict=True):
            assert ids == ref["output_ids"]
        assert gw.monitor.workers["sg0"].state is WorkerState.FAILED
        interrupted = (
            [it for s in gw.sessions.recent_interrupted for it in s.interruptions] if gw.sessions else []
        )
        assert interrupted and {it.worker_id for it in interrupted} == {"sg0"}
