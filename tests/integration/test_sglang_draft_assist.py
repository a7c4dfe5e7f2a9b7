"""Draft assist on an SGLang target, verified by the gateway: a drafter (at the draft-plane seam: a
ZMQ ROUTER speaking Lumen's draft protocol, proposing the target's greedy tokens with every third one
wrong) is paired with a busy stand-in SGLang server; the gateway verifies each round with one
`/generate` call through the stand-in's logprob path. Accepted tokens > 0, and the output is exactly
plain greedy decoding's."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from gateway.protocol import control_pb2 as pb
from gateway.protocol.draft import DraftReply, DraftTokens, decode_request, encode_reply
from gateway.protocol.planes import PlaneAuth, curve_server
from gateway.server.app import Gateway
from tests.fixtures.sglang_standin import expected_ids
from tests.fixtures.sglang_standin_model import greedy_ids
from tests.integration.test_sglang_gateway import sglang_cluster, stream_ids, wait_until

WRONG_EVERY = 3


@contextlib.asynccontextmanager
async def fake_drafter() -> AsyncIterator[tuple[str, dict[str, int], str]]:
    """A drafter at the draft-plane seam: proposes the stand-in's greedy continuation, every
    WRONG_EVERY-th token off by one; a CURVE server (no ZAP handler: any client key is taken). Yields
    its endpoint, its counters and its plane key."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    auth = PlaneAuth.generate()
    curve_server(sock, auth, "lumen.draft")
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    contexts: dict[tuple[bytes, str], list[int]] = {}
    stats = {"rounds": 0, "proposed": 0}

    async def serve() -> None:
        while True:
            peer, buf = await sock.recv_multipart()
            req = decode_request(buf)
            drafts = []
            for item in req.batch:
                key = (peer, item.rid)
                ctx_ids = list(item.sync_tokens) if item.full else [*contexts.get(key, []), *item.sync_tokens]
                contexts[key] = ctx_ids
                good = greedy_ids(ctx_ids, item.k)
                toks = [t + 1 if (len(ctx_ids) + i) % WRONG_EVERY == 0 else t for i, t in enumerate(good)]
                drafts.append(DraftTokens(rid=item.rid, tokens=toks))
                stats["proposed"] += len(toks)
            for rid in req.release:
                contexts.pop((peer, rid), None)
            stats["rounds"] += 1
            await sock.send_multipart([peer, encode_reply(DraftReply(round=req.round, drafts=drafts))])

    task = asyncio.create_task(serve())
    try:
        yield f"tcp://127.0.0.1:{port}", stats, auth.keys.public
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        sock.close(0)
        ctx.term()


async def restarting_drafter(gw: Gateway, endpoint: str, key: str) -> asyncio.Task[None]:
    """A restarting worker that has only its draft model: incarnation 1 served and failed, incarnation
    2 reports DRAFT_READY (heartbeating so the monitor keeps it alive)."""
    gw.monitor.attach(pb.Hello(worker_id="d0", incarnation=1, phase=pb.SERVING, http_url="http://unused"))
    gw.monitor.report_data_failure("d0", 1, "killed")
    rec = gw.monitor.attach(
        pb.Hello(
            worker_id="d0",
            incarnation=2,
            phase=pb.DRAFT_READY,
            draft_endpoint=endpoint,
            http_url="http://unused",
            plane_key=key,
        )
    )
    rec.plane_key = key  # what the control plane records from the Hello

    async def beat() -> None:
        while True:
            gw.monitor.heartbeat(rec, pb.Heartbeat(phase=pb.DRAFT_READY))
            await asyncio.sleep(0.01)

    return asyncio.create_task(beat())


async def test_gateway_verified_drafts_are_accepted_and_output_is_exact() -> None:
    # the verification mechanics, not when pairing pays: the assist gate (draft.assist_gate, tested in
    # tests/unit/test_core_assist_gate.py) would not pair a drafter with a target this lightly loaded
    async with (
        sglang_cluster(n=1, **{"draft.assist_gate": False}) as (gw, servers, http),
        fake_drafter() as (endpoint, stats, key),
    ):
        beat = await restarting_drafter(gw, endpoint, key)
        try:
            # load on the target (plain streams) so that Algorithm 3 pairs the drafter with it
            load = [
                asyncio.create_task(stream_ids(http, list(b"background %d" % i), False, 400)) for i in range(3)
            ]
            await wait_until(lambda: gw.assist is not None and gw.assist.pairs == {"d0": "sg0"}, 10.0)
            prompts = [list(b"assisted request %d" % i) for i in range(4)]
            got = await asyncio.gather(*(stream_ids(http, p, False) for p in prompts))
            for task in load:
                task.cancel()
            await asyncio.gather(*load, return_exceptions=True)
        finally:
            beat.cancel()
        for p, ids in zip(prompts, got, strict=True):
            assert ids == expected_ids(p, 48, 0.0)
        assert gw.verifier is not None
        proposed, accepted = gw.verifier.drafted.get("sg0", 0), gw.verifier.accepted.get("sg0", 0)
        assert stats["rounds"] > 0 and proposed > 0
        assert 0 < accepted < proposed  # some drafts right, the off-by-one ones rejected
        assert all(s.stats()["refused"] == [] for s in servers)
