"""Draft assist on SGLang targets, verified by the gateway (SGLang has no remote-drafter API).

While a restarting worker has only its draft model, the coordinator pairs it with the most loaded
survivor (Algorithm 3). A Lumen target verifies the drafts inside its own step; an unmodified SGLang
target cannot, so the gateway runs the loop itself for the greedy requests it sends there: ask the
drafter for k tokens over the draft plane (gateway/protocol/draft.py, the same DEALER ↔ ROUTER
protocol a Lumen target speaks), verify them with ONE `/generate` call on the target
(`gateway.protocol.sglang.verify_body`), keep the longest prefix the target agrees with plus its own
next token, repeat. The output is exactly plain greedy decoding's; k adapts to the measured
acceptance (`gateway.core.speculation`). Sampled requests are never assisted this way (exactness).

`AssistedStream` has WorkerStream's interface, so a session's failover loop treats an assisted
attempt like any other: a broken target connection or a stall is `WorkerLost`. A silent drafter only
costs time: a round without drafts is a plain one-token step. A target that refuses a verification
call with a 4xx while it carries drafts (a drafter of another vocabulary: ids the target cannot take)
refuses the drafts, not the request: that round is made again without drafts, the stream goes on
plainly, and the verifier drops that drafter for that target (`refused`); the client never sees it.
A refusal of a call without drafts is the request's own (`WorkerRefused`, as for a plain stream).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable
from types import TracebackType

import aiohttp
import msgspec
import structlog
import zmq
import zmq.asyncio

from gateway.core.losses import Loss
from gateway.core.speculation import AcceptanceEstimator, choose_k
from gateway.protocol.draft import (
    DraftItem,
    DraftProtocolError,
    DraftReply,
    DraftRequest,
    decode_reply,
    encode_request,
)
from gateway.protocol.generate import FinishReason, GenerateChunk, MetaInfo, encode
from gateway.protocol.planes import CurveKeypair, curve_client, is_key
from gateway.protocol.sglang import SGLangGenerate, SGLangVerifyResponse, verified_tokens, verify_body
from gateway.protocol.zap import RetryRefused
from gateway.server.recovery.pairing import DrafterRef
from gateway.server.workers.client import WorkerLost, WorkerRefused

log = structlog.get_logger("lumen.assisted")

# the extra cost of one drafted token in a verification call, as a fraction of a plain step: a
# verification is one prefill of k + 1 tokens over a cached context, nearly a decode step's cost
VERIFY_COST_PER_DRAFT = 0.05


class DraftPlane:
    """The gateway's DEALER to one drafter; rounds of many sessions share it, matched by round. A CURVE
    client with the gateway's keys (announced to every worker in Members), to the drafter's key."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        timeout_s: float,
        *,
        keys: CurveKeypair,
        server_key: str,
    ) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        curve_client(self._sock, keys, server_key)
        self._sock.connect(endpoint)
        self._retry = RetryRefused(self._sock, endpoint)  # a drafter that had not heard of us yet
        self._rounds = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[DraftReply]] = {}
        self._reader = asyncio.get_running_loop().create_task(self._read(), name=f"draft-plane-{endpoint}")

    async def drafts(self, item: DraftItem) -> tuple[list[int], bool]:
        """(drafts, resync) for one item; ([], False) when the drafter does not answer in time."""
        rnd = next(self._rounds)
        fut: asyncio.Future[DraftReply] = asyncio.get_running_loop().create_future()
        self._waiting[rnd] = fut
        try:
            await self._sock.send(encode_request(DraftRequest(round=rnd, batch=[item])))
            reply = await asyncio.wait_for(fut, self.timeout_s)
        except TimeoutError:
            return [], False
        finally:
            self._waiting.pop(rnd, None)
        for d in reply.drafts:
            if d.rid == item.rid:
                return list(d.tokens[: item.k]), d.resync
        return [], False

    async def release(self, rid: str) -> None:
        with contextlib.suppress(zmq.ZMQError):
            await self._sock.send(
                encode_request(DraftRequest(round=next(self._rounds), batch=[], release=[rid]))
            )

    async def _read(self) -> None:
        while True:
            buf = await self._sock.recv()
            try:
                reply = decode_reply(buf)
            except DraftProtocolError as exc:
                log.warning("draft_reply_refused", endpoint=self.endpoint, error=str(exc))
                continue
            fut = self._waiting.get(reply.round)
            if fut is not None and not fut.done():
                fut.set_result(reply)

    async def close(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        await self._retry.close()
        self._sock.close(0)


class AssistedStream:
    """One greedy attempt on an SGLang target, decoded in drafted rounds (WorkerStream's interface)."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        url: str,
        body: SGLangGenerate,
        plane: DraftPlane,
        estimator: AcceptanceEstimator,
        *,
        k_min: int,
        k_max: int,
        timeout_s: float,
    ) -> None:
        self._http = http
        self._url = url.rstrip("/") + "/generate"
        self._body = body
        self._plane = plane
        self.estimator = estimator
        self._k_min, self._k_max = k_min, k_max
        # the gateway's stop ids already hold the tokenizer's EOS unless the request ignores it
        self._stop = frozenset(body.sampling_params.stop_token_ids)
        self._timeout_s = timeout_s
        self._context = list(body.input_ids)
        self._prompt_tokens = len(body.input_ids)
        self._remaining = body.sampling_params.max_new_tokens
        self._emitted = 0
        self._synced = 0  # context ids the drafter has
        self._done = False
        self._interrupted: WorkerLost | None = None
        self._inflight: asyncio.Task[SGLangVerifyResponse] | None = None
        self.drafted = 0
        self.accepted = 0
        # the target refused a verification call for its drafts (a 4xx): plain decoding from then on
        self.refused: WorkerRefused | None = None

    def interrupt(self, reason: str, kind: Loss = Loss.FENCED) -> None:
        if self._interrupted is None:
            self._interrupted = WorkerLost(reason, kind)
        if self._inflight is not None:
            self._inflight.cancel()

    async def __aenter__(self) -> AssistedStream:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._plane.release(self._body.rid)

    async def next_chunk(self) -> GenerateChunk | None:
        if self._done:
            return None
        if self._interrupted is not None:
            raise WorkerLost(self._interrupted.reason, self._interrupted.kind)
        k = (
            0
            if self.refused is not None
            else min(
                choose_k(self.estimator.rate, self._k_min, self._k_max, VERIFY_COST_PER_DRAFT),
                self._remaining - 1,
            )
        )
        drafts: list[int] = []
        if k > 0:
            full = self._synced == 0
            item = DraftItem(
                rid=self._body.rid,
                sync_tokens=self._context if full else self._context[self._synced :],
                position=len(self._context),
                k=k,
                full=full,
            )
            drafts, resync = await self._plane.drafts(item)
            self._synced = 0 if resync else len(self._context)
        try:
            resp = await self._verify(drafts)
        except WorkerRefused as exc:
            if not drafts or not 400 <= exc.status < 500 or exc.status in (408, 409, 429):
                raise  # the target's trouble or load (a retry elsewhere), the session's to handle
            # the drafts made the target refuse the call: the drafter's fault, never the client's
            self.refused = exc
            log.warning(
                "drafts_refused_by_target", rid=self._body.rid, status=exc.status, error=exc.message[:200]
            )
            drafts = []
            resp = await self._verify(drafts)
        try:
            tokens, n_ok = verified_tokens(drafts, resp)
        except ValueError as exc:
            raise WorkerLost(f"verification answer unusable: {exc}", Loss.WORKER_ERROR) from exc
        self.drafted += len(drafts)
        self.accepted += n_ok
        self.estimator = self.estimator.update(n_ok, len(drafts))
        return self._emit(tokens, resp.meta_info.cached_tokens)

    def _emit(self, tokens: list[int], cached: int) -> GenerateChunk:
        tokens = tokens[: self._remaining]
        finish: FinishReason | None = None
        for i, t in enumerate(tokens):
            if t in self._stop:
                tokens = tokens[: i + 1]
                finish = FinishReason(type="stop", matched=t)
                break
        self._context.extend(tokens)
        self._emitted += len(tokens)
        self._remaining -= len(tokens)
        if finish is None and self._remaining <= 0:
            finish = FinishReason(type="length", length=self._emitted)
        self._done = finish is not None
        meta = MetaInfo(
            id=self._body.rid,
            prompt_tokens=self._prompt_tokens,
            completion_tokens=self._emitted,
            cached_tokens=cached,
            finish_reason=finish,
        )
        return GenerateChunk(tokens, meta, None)

    async def _verify(self, drafts: list[int]) -> SGLangVerifyResponse:
        body = verify_body(self._body.rid, self._context, drafts)
        self._inflight = asyncio.get_running_loop().create_task(self._post(body))
        try:
            return await self._inflight
        except asyncio.CancelledError:
            if self._interrupted is not None:
                raise WorkerLost(self._interrupted.reason, self._interrupted.kind) from None
            raise
        finally:
            self._inflight = None

    async def _post(self, body: SGLangGenerate) -> SGLangVerifyResponse:
        try:
            async with self._http.post(
                self._url,
                data=encode(body),
                headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=self._timeout_s),
            ) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    raise WorkerRefused(resp.status, raw.decode(errors="replace"))
        except TimeoutError as exc:
            raise WorkerLost(
                f"stall: no verification answer for {self._timeout_s:.3g} s", Loss.STALLED
            ) from exc
        except (aiohttp.ClientError, ConnectionError) as exc:
            raise WorkerLost(f"verification call broke: {exc!r}", Loss.CONNECTION) from exc
        try:
            return msgspec.json.decode(raw, type=SGLangVerifyResponse)
        except msgspec.DecodeError as exc:
            raise WorkerLost(f"malformed verification answer: {exc}", Loss.WORKER_ERROR) from exc


class GatewayVerifier:
    """Draft assist for the SGLang targets the coordinator paired: one DraftPlane per drafter, one
    acceptance estimate per (drafter, target) pair."""

    def __init__(
        self,
        *,
        drafter_of: Callable[[str], DrafterRef | None],
        k_min: int,
        k_max: int,
        draft_timeout_s: float,
        prior: float,
    ) -> None:
        self._drafter_of = drafter_of  # target id -> its drafter, or None
        self.k_min, self.k_max = k_min, k_max
        self.draft_timeout_s = draft_timeout_s
        self.prior = prior
        self._ctx: zmq.asyncio.Context | None = None
        self._planes: dict[tuple[str, str], DraftPlane] = {}  # (endpoint, drafter key) -> plane
        self._estimates: dict[tuple[str, str], AcceptanceEstimator] = {}
        # (drafter, target) pairs whose drafts the target refused (a 4xx): never assisted again
        self._refused: set[tuple[str, str]] = set()
        self.drafted: dict[str, int] = {}  # per target: drafts verified
        self.accepted: dict[str, int] = {}

    def for_target(self, target: str) -> tuple[str, DraftPlane, AcceptanceEstimator] | None:
        """(drafter id, its plane, the pair's estimate) while `target` has a drafter, else None."""
        found = self._drafter_of(target)
        if found is None or (found.drafter_id, target) in self._refused:
            return None
        drafter, endpoint, server_key = found.drafter_id, found.endpoint, found.server_key
        if not endpoint or not is_key(server_key):
            return None  # no draft plane, or none the gateway can authenticate
        plane = self._planes.get((endpoint, server_key))
        if plane is None:
            if self._ctx is None:
                self._ctx = zmq.asyncio.Context()
            plane = self._planes[(endpoint, server_key)] = DraftPlane(
                self._ctx, endpoint, self.draft_timeout_s, keys=found.client_keys, server_key=server_key
            )
        est = self._estimates.get((drafter, target)) or AcceptanceEstimator(prior=self.prior)
        return drafter, plane, est

    def record(self, drafter: str, target: str, stream: AssistedStream) -> None:
        self._estimates[(drafter, target)] = stream.estimator
        if stream.refused is not None:  # its drafts are not the target's tokens: not paired again
            self._refused.add((drafter, target))
        self.drafted[target] = self.drafted.get(target, 0) + stream.drafted
        self.accepted[target] = self.accepted.get(target, 0) + stream.accepted

    async def close(self) -> None:
        for plane in self._planes.values():
            await plane.close()
        self._planes.clear()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
