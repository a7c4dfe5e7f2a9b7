"""The draft-assist plane over real ZMQ (tcp loopback): DrafterServer <-> DraftClient, and a target
loop that decodes whole requests with a drafter's help."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import structlog
import zmq
import zmq.asyncio

from draft_models.client import Draft, DraftClient
from draft_models.drafter import DrafterServer
from draft_models.synthetic_drafter import SyntheticDrafter, verify_synthetic
from draft_models.verify import Uniforms, VerifyMode, mode_for
from gateway.core.costmodel import CostModel
from gateway.protocol import draft
from gateway.protocol.generate import SamplingParams
from gateway.protocol.planes import PLAINTEXT
from models.synthetic import Sampler, SyntheticModel, expected_output, finish_of, mix64

TIMEOUT = 2.0  # generous: the loopback round trip is well under a millisecond


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
async def server(ctx: zmq.asyncio.Context) -> AsyncIterator[DrafterServer]:
    async with DrafterServer(SyntheticDrafter(0.7), auth=PLAINTEXT, ctx=ctx, time_scale=0.0) as s:
        yield s


@pytest.fixture
def client(ctx: zmq.asyncio.Context, server: DrafterServer) -> Iterator[DraftClient]:
    c = DraftClient(server.endpoint, auth=PLAINTEXT, ctx=ctx, pair="Qwen3-32B->Qwen3-1.7B")
    yield c
    c.close()


async def connect(client: DraftClient) -> None:
    """Empty rounds until one is answered: IMMEDIATE refuses sends until the connection is up."""
    deadline = time.monotonic() + TIMEOUT
    round = -1
    while True:
        round -= 1
        client.request(-round, [])
        if await client.poll(-round, 0.05) is not None:
            return
        assert time.monotonic() < deadline, "drafter never answered"


async def first_round(client: DraftClient, items: list[draft.DraftItem], round: int = 1) -> dict[str, Draft]:
    await connect(client)
    client.request(round, items)
    got = await client.poll(round, TIMEOUT)
    assert got is not None
    return got


async def test_drafts_arrive_with_k_respected_and_q_when_asked(client: DraftClient) -> None:
    items = [
        client.sync_item("a", [1, 2, 3], 1),
        client.sync_item("b", list(range(40)), 5, temperature=0.8, seed_base=9, want_q=True),
        client.sync_item("c", [7], 0),
    ]
    assert all(i.full for i in items)
    got = await first_round(client, items)
    assert {rid: len(d.tokens) for rid, d in got.items()} == {"a": 1, "b": 5, "c": 0}
    assert got["a"].q is None
    q = got["b"].q
    assert q is not None and len(q) == 5 and all(abs(sum(r.probs) - 1) < 1e-9 for r in q)
    # the next round sends only what was accepted since
    nxt = client.sync_item("a", [1, 2, 3, 50, 51], 3)
    assert not nxt.full and nxt.sync_tokens == [50, 51] and nxt.position == 5
    client.request(2, [nxt])
    again = await client.poll(2, TIMEOUT)
    assert again is not None and len(again["a"].tokens) == 3
    assert client.stats.replies >= 2 and client.stats.timeouts == 0


async def test_stale_rounds_are_dropped(client: DraftClient, server: DrafterServer) -> None:
    await first_round(client, [client.sync_item("a", [1, 2], 2)])
    client.request(2, [client.sync_item("a", [1, 2, 3], 2)])
    # round 2's reply lands, unread; round 3 must not take it
    await asyncio.sleep(0.1)
    client.request(3, [client.sync_item("a", [1, 2, 3, 4], 4)])
    got = await client.poll(3, TIMEOUT)
    assert got is not None and len(got["a"].tokens) == 4
    assert client.stats.stale == 1


async def test_a_slow_drafter_times_out_and_catches_up(ctx: zmq.asyncio.Context) -> None:
    # ~4 ms per modelled draft step x 25: one round of 4 drafts takes ~0.4 s of wall time
    cost = CostModel.preset("Qwen3-1.7B", "H100-80G")
    async with DrafterServer(SyntheticDrafter(0.7), auth=PLAINTEXT, ctx=ctx, cost=cost, time_scale=25.0) as srv:
        c = DraftClient(srv.endpoint, auth=PLAINTEXT, ctx=ctx)
        try:
            # wait for the connection without a round (IMMEDIATE: sends before it are refused)
            while True:
                c.request(0, [])
                if c.stats.rounds:
                    break
                await asyncio.sleep(0.01)
            t0 = time.monotonic()
            c.request(1, [c.sync_item("a", list(range(100)), 4)])
            assert await c.poll(1, 0.03) is None
            assert time.monotonic() - t0 < 0.03 + 0.1  # + scheduling slack
            # rounds 2 and 3 queue behind round 1: round 2 is superseded, its sync still applies
            c.request(2, [c.sync_item("a", [*range(100), 1], 4)])
            c.request(3, [c.sync_item("a", [*range(100), 1, 2], 4)])
            got = await c.poll(3, TIMEOUT)
            assert got is not None and len(got["a"].tokens) == 4
            assert c.stats.timeouts == 1 and srv.stats.superseded >= 1 and srv.stats.resyncs == 0
            assert srv.stats.modelled_s > 0
        finally:
            c.close()


async def test_a_closed_drafter_makes_poll_return_none_within_the_timeout(
    ctx: zmq.asyncio.Context,
) -> None:
    srv = DrafterServer(SyntheticDrafter(0.7), auth=PLAINTEXT, ctx=ctx, time_scale=0.0)
    await srv.start()
    c = DraftClient(srv.endpoint, auth=PLAINTEXT, ctx=ctx)
    try:
        await first_round(c, [c.sync_item("a", [1, 2], 2)])
        await srv.close()
        for r in range(2, 6):
            t0 = time.monotonic()
            c.request(r, [c.sync_item("a", [1, 2, r], 2)])
            assert await c.poll(r, 0.05) is None
            assert time.monotonic() - t0 < 0.05 + 0.1  # + scheduling slack
        assert c.stats.timeouts + c.stats.unsent >= 4
    finally:
        c.close()


async def test_a_restarted_drafter_asks_for_a_resync(ctx: zmq.asyncio.Context) -> None:
    first = DrafterServer(SyntheticDrafter(0.7), auth=PLAINTEXT, ctx=ctx, time_scale=0.0)
    endpoint = await first.start()
    c = DraftClient(endpoint, auth=PLAINTEXT, ctx=ctx)
    try:
        await first_round(c, [c.sync_item("a", [1, 2], 2)])
        await first.close()
        second = DrafterServer(SyntheticDrafter(0.7), endpoint, auth=PLAINTEXT, ctx=ctx, time_scale=0.0)
        deadline = time.monotonic() + TIMEOUT
        while True:  # the closed socket frees its port asynchronously
            try:
                await second.start()
                break
            except OSError:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
        try:
            # an incremental sync the new drafter cannot apply: no drafts, and a resync
            got = await first_round(c, [c.sync_item("a", [1, 2, 3], 2)], round=2)
            assert got == {} and c.stats.resyncs == 1 and second.stats.resyncs == 1
            item = c.sync_item("a", [1, 2, 3, 4], 2)
            assert item.full and item.sync_tokens == [1, 2, 3, 4]
            c.request(3, [item])
            fresh = await c.poll(3, TIMEOUT)
            assert fresh is not None and len(fresh["a"].tokens) == 2
        finally:
            await second.close()
    finally:
        c.close()


async def test_states_are_bounded_lru_and_released(ctx: zmq.asyncio.Context) -> None:
    async with DrafterServer(SyntheticDrafter(0.7), auth=PLAINTEXT, ctx=ctx, time_scale=0.0, max_states=2) as srv:
        c = DraftClient(srv.endpoint, auth=PLAINTEXT, ctx=ctx)
        try:
            await first_round(c, [c.sync_item(rid, [1, 2], 1) for rid in ("a", "b", "c")])
            assert srv.n_states == 2 and srv.stats.evicted == 1
            # "a" was evicted: the drafter asks for it again
            c.request(2, [c.sync_item(rid, [1, 2, 3], 1) for rid in ("a", "b", "c")])
            got = await c.poll(2, TIMEOUT)
            assert got is not None and set(got) == {"b", "c"} and c.stats.resyncs == 1
            c.forget("b")
            c.forget("c")
            c.request(3, [])
            assert await c.poll(3, TIMEOUT) == {}
            assert srv.n_states == 0 and srv.stats.released == 2
        finally:
            c.close()


async def test_bad_messages_are_refused_and_the_drafter_keeps_serving(
    ctx: zmq.asyncio.Context, server: DrafterServer, client: DraftClient
) -> None:
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(server.endpoint)
    try:
        with structlog.testing.capture_logs() as logs:
            await raw.send(b"\xc1garbage")
            await raw.send_multipart([b"two", b"frames"])
            await raw.send(b"\x83\xa1v\x02\xa5round\x01\xa5batch\x90")  # v = 2
            await raw.send(draft.encode_request(draft.DraftRequest(round=1, batch=[])))
            assert await asyncio.wait_for(raw.recv(), TIMEOUT)  # the valid one is answered
        assert server.stats.refused == 3
        reasons = [e["reason"] for e in logs if e["event"] == "draft_message_refused"]
        assert any("version 2 is not supported" in r for r in reasons) and len(reasons) == 3
        got = await first_round(client, [client.sync_item("a", [5], 2)])
        assert len(got["a"].tokens) == 2
    finally:
        raw.close(0)


async def test_the_client_drops_bad_and_stale_replies(ctx: zmq.asyncio.Context) -> None:
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:0")
    c = DraftClient(router.getsockopt_string(zmq.LAST_ENDPOINT), auth=PLAINTEXT, ctx=ctx)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not c.stats.rounds:  # IMMEDIATE: wait for the connection
            c.request(1, [c.sync_item("a", [1], 2)])
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        ident, _ = await asyncio.wait_for(router.recv_multipart(), TIMEOUT)
        bad_q = draft.DraftTokens("a", [5], q_probs=[draft.QDist([5], [0.5])])
        for payload in (
            b"\xc1garbage",
            draft.encode_reply(draft.DraftReply(round=1, drafts=[bad_q])),
            draft.encode_reply(draft.DraftReply(round=0, drafts=[draft.DraftTokens("a", [], resync=True)])),
            draft.encode_reply(draft.DraftReply(round=1, drafts=[draft.DraftTokens("a", [5, 6])])),
        ):
            await router.send_multipart([ident, payload])
        got = await c.poll(1, TIMEOUT)
        assert got is not None and got["a"].tokens == (5, 6)
        assert (c.stats.refused, c.stats.stale, c.stats.resyncs) == (2, 1, 1)
        # the stale reply's resync still counts: the next item for "a" carries the full context
        assert c.sync_item("a", [1, 5], 2).full
    finally:
        c.close()
        router.close(0)


# -- a target loop decoding whole requests with the drafter's help -------------------------------------
async def decode(
    client: DraftClient,
    rid: str,
    prompt: list[int],
    params: SamplingParams,
    seed_base: int,
    mode: VerifyMode,
    k: int,
) -> tuple[list[int], int]:
    model = SyntheticModel(0, 32, 127)
    sampler = Sampler.from_params(params, seed_base)
    uniforms = Uniforms(seed_base)
    stop_ids = frozenset(params.stop_token_ids)
    want_q = mode is VerifyMode.REJECTION
    context = list(prompt)
    h, out, steps = model.absorb(model.initial_state(), prompt), [], 0
    while True:
        steps += 1
        item = client.sync_item(
            rid,
            context,
            k,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed_base=seed_base,
            want_q=want_q,
        )
        client.request(steps, [item])
        got = await client.poll(steps, TIMEOUT)
        d = got.get(rid) if got else None
        drafts = d.tokens if d else ()
        verdict = verify_synthetic(
            model, h, len(context), sampler, drafts, mode=mode, q_rows=d.q if d else (), uniforms=uniforms
        )
        client.record(len(drafts), verdict.accepted)
        for t in verdict.tokens:
            out.append(t)
            context.append(t)
            h = mix64(h ^ t)
            if finish_of(t, len(out), params, stop_ids) is not None:
                client.forget(rid)
                return out, steps


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
async def test_a_drafter_at_agreement_0_7_drives_exact_decoding(
    client: DraftClient, temperature: float
) -> None:
    await first_round(client, [])
    params = SamplingParams(max_new_tokens=400, temperature=temperature, top_p=0.95, ignore_eos=True)
    mode = mode_for(Sampler.from_params(params, 5))
    out, steps = await decode(client, "r1", [3, 1, 4, 1, 5], params, 5, mode, k=4)
    assert out == expected_output([3, 1, 4, 1, 5], params, 5)[0]
    acceptance = client.stats.acceptance
    assert acceptance is not None and 0.6 < acceptance < 0.8, acceptance
    # (1 - 0.7^5) / 0.3 ≈ 2.77 expected
    assert len(out) / steps > 2.0
    assert client.stats.timeouts == 0 and client.stats.resyncs == 0


async def test_rejection_sampling_over_the_wire(client: DraftClient) -> None:
    await first_round(client, [])
    params = SamplingParams(max_new_tokens=300, temperature=1.0, ignore_eos=True)
    out, steps = await decode(client, "r1", [2, 7], params, 11, VerifyMode.REJECTION, k=4)
    assert len(out) == 300 and all(32 <= t < 127 for t in out)
    acceptance = client.stats.acceptance
    assert acceptance is not None and 0.6 < acceptance < 0.8, acceptance
    assert len(out) / steps > 2.0


class _SlowDrafter(SyntheticDrafter):
    """A draft model whose proposals take real time, as a real model's forwards do."""

    def propose(self, state: Any, k: int, sampler: Sampler, *, want_q: bool = False) -> Any:
        time.sleep(0.05)
        return super().propose(state, k, sampler, want_q=want_q)


async def test_a_drafter_with_a_thread_keeps_the_event_loop_free(ctx: zmq.asyncio.Context) -> None:
    """With a thread, a round's forwards never hold the loop (its worker's heartbeats run there)."""
    with ThreadPoolExecutor(1) as thread:
        async with DrafterServer(_SlowDrafter(0.7), auth=PLAINTEXT, ctx=ctx, time_scale=0.0, thread=thread) as srv:
            c = DraftClient(srv.endpoint, auth=PLAINTEXT, ctx=ctx)
            try:
                await connect(c)
                lags: list[float] = []

                async def ticker() -> None:
                    while True:
                        t = time.perf_counter()
                        await asyncio.sleep(0.005)
                        lags.append(time.perf_counter() - t - 0.005)

                tick = asyncio.create_task(ticker())
                items = [c.sync_item(f"r{i}", [1, 2, 3], 4) for i in range(4)]  # 4 x 50 ms of "forwards"
                c.request(1, items)
                got = await c.poll(1, TIMEOUT)
                tick.cancel()
                assert got is not None and len(got) == 4
                # without the thread the loop stalls for the whole round (~200 ms)
                assert max(lags) < 0.1, f"the loop stalled {max(lags) * 1000:.0f} ms"
            finally:
                c.close()
