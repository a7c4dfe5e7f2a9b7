"""The drafter's side of the draft-assist plane: a ROUTER socket answering DraftRequests.

`DrafterServer` binds at the drafter's `draft_endpoint` (tcp://127.0.0.1:0 picks a free port;
`endpoint` reports the bound one), keeps one `DraftState` per (target connection, rid) in a bounded LRU,
and answers each round with up to k drafts per rid. It models the draft model's time on its GPU with
the cost model of the draft preset: a round costs one step that absorbs every synced id (and yields the
first draft), then one decode step per further draft position, batched over the round's requests;
the wall time is that × `time_scale`.

Rounds that queued up behind a newer round from the same target are superseded: their syncs and
releases still apply, in order, but they get no reply (the target would drop it as stale anyway), so
a slow drafter catches up instead of falling further behind. A bad message is refused and logged and
changes nothing. It owns one task, started by `start()` and ended by `close()`.

A real draft model computes for real: given a `thread` (a single-worker executor), each round's
work runs there, so the worker's event loop (its heartbeats, its own streams) never waits on a
forward; rounds stay one at a time, and `close()` waits for the one in flight before it clears state.

Security (`gateway.protocol.planes`; the socket's set-up is `gateway.protocol.plane_server.PlaneServer`,
the KV store's too): with a `PlaneAuth` the ROUTER is a CURVE server whose context's
ZAP handler admits current members and the gateways (which verify drafts for SGLang targets); every
message is checked again on arrival (`unauthenticated` when its connection's key is no longer one of
them), so a fenced worker's open connection gets no drafts. `PLAINTEXT` is for unit tests only.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import ClassVar, cast

import structlog
import zmq
import zmq.asyncio

from draft_models.draft_model import DraftModel, DraftState
from gateway.core.costmodel import CostModel, StepWork
from gateway.protocol.draft import (
    DraftItem,
    DraftProtocolError,
    DraftReply,
    DraftRequest,
    DraftTokens,
    QDist,
    decode_request,
    encode_reply,
)
from gateway.protocol.generate import SamplingParams
from gateway.protocol.plane_server import PlaneServer
from gateway.protocol.planes import DRAFT_DOMAIN, PlaneAuth, Security, user_id
from models.synthetic import Sampler

log = structlog.get_logger("lumen.draft.drafter")


@dataclass(slots=True)
class DrafterStats:
    messages: int = 0
    refused: int = 0
    rounds: int = 0  # answered
    superseded: int = 0
    items: int = 0
    drafted: int = 0
    resyncs: int = 0
    evicted: int = 0
    released: int = 0
    unauthenticated: int = 0  # refused: the connection's key is not a current member's (CURVE)
    modelled_s: float = 0.0  # draft-model GPU time, before time_scale


@dataclass(slots=True)
class _Work:
    """One round's cost-model inputs."""

    syncs: list[tuple[int, int]]  # (ids absorbed, context before them)
    drafts: list[tuple[int, int, bool]]  # (position, k, had a sync in the first step)


class DrafterServer(PlaneServer):
    noun: ClassVar[str] = "drafter"
    plane: ClassVar[str] = "draft"
    domain: ClassVar[str] = DRAFT_DOMAIN
    socket_type: ClassVar[int] = zmq.ROUTER
    admits_gateways: ClassVar[bool] = True  # the gateways verify drafts for SGLang targets

    stats: DrafterStats

    def __init__(
        self,
        model: DraftModel,
        endpoint: str = "tcp://127.0.0.1:0",
        *,
        auth: Security,
        ctx: zmq.asyncio.Context | None = None,
        cost: CostModel | None = None,
        time_scale: float = 1.0,
        max_states: int = 4096,
        max_drain: int = 256,
        thread: Executor | None = None,
    ) -> None:
        if max_states < 1:
            raise ValueError(f"max_states must be >= 1, got {max_states}")
        if time_scale < 0:
            raise ValueError(f"time_scale must be >= 0, got {time_scale}")
        super().__init__(endpoint, auth=auth, ctx=ctx, refusal_event="draft_message_refused")
        self.model = model
        self.cost = cost
        self.time_scale = time_scale
        self.max_states = max_states
        self._max_drain = max_drain
        # (target connection, rid) -> state, least recently used first
        self._states: OrderedDict[tuple[bytes, str], DraftState] = OrderedDict()
        self.stats = DrafterStats()
        self._thread = thread
        self._inflight: asyncio.Future[tuple[list[list[bytes]], float]] | None = None

    @property
    def n_states(self) -> int:
        return len(self._states)

    def _started(self) -> None:
        log.info(
            "drafter_listening",
            endpoint=self.endpoint,
            max_states=self.max_states,
            curve=isinstance(self.auth, PlaneAuth),
        )

    async def _stopping(self) -> None:
        if self._inflight is not None:  # a round still running on the thread: let it finish first
            await asyncio.gather(self._inflight, return_exceptions=True)
            self._inflight = None

    async def close(self) -> None:
        await super().close()
        self._states.clear()

    async def _run(self) -> None:
        sock = self._socket()
        while True:
            batch: list[list[bytes]] = []
            try:
                batch = self._admitted([await sock.recv_multipart(copy=False)])
                # take what else has queued meanwhile: superseded rounds are answered by their successor
                while len(batch) < self._max_drain and cast(int, sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                    batch.extend(self._admitted([await sock.recv_multipart(zmq.NOBLOCK, copy=False)]))
            except zmq.Again:
                pass  # pyzmq saw POLLIN but the message was gone by the recv (a connection just closed)
            if not batch:
                continue
            try:
                if self._thread is None:
                    replies, seconds = self.handle(batch)
                else:
                    self._inflight = asyncio.wrap_future(self._thread.submit(self.handle, batch))
                    replies, seconds = await self._inflight
                    self._inflight = None
            except Exception:  # the outermost loop: one bad round must not stop the drafter
                self.stats.refused += len(batch)
                log.exception("draft_round_failed", messages=len(batch))
                continue
            if seconds > 0.0 and self.time_scale > 0.0:
                await asyncio.sleep(seconds * self.time_scale)
            for frames in replies:
                await sock.send_multipart(frames)

    def _admitted(self, received: list[list[zmq.Frame]]) -> list[list[bytes]]:
        """The received messages as bytes, less those whose connection is not (or no longer) a
        current member's or a gateway's (CURVE mode: counted and logged, never handled)."""
        out: list[list[bytes]] = []
        for frames in received:
            if isinstance(self.auth, PlaneAuth):
                key = user_id(frames[-1])
                if key is None or not self.admits(key):
                    self._refuse_stranger(key)
                    continue
            out.append([f.bytes for f in frames])
        return out

    def handle(self, messages: list[list[bytes]]) -> tuple[list[list[bytes]], float]:
        """Apply received messages; return the reply frames and the modelled draft time in seconds."""
        decoded: list[tuple[bytes, DraftRequest]] = []
        for frames in messages:
            self.stats.messages += 1
            if len(frames) != 2:
                self.stats.refused += 1
                log.warning("draft_message_refused", reason=f"{len(frames)} frames, expected 2")
                continue
            try:
                decoded.append((frames[0], decode_request(frames[1])))
            except DraftProtocolError as exc:
                self.stats.refused += 1
                log.warning("draft_message_refused", reason=str(exc))
        newest: dict[bytes, DraftRequest] = {}
        for peer, request in decoded:
            if peer not in newest or request.round >= newest[peer].round:
                newest[peer] = request
        work = _Work([], [])
        replies: list[list[bytes]] = []
        for peer, request in decoded:
            answer = newest[peer] is request
            drafts = [self._item(peer, item, answer, work) for item in request.batch]
            for rid in request.release:
                if self._states.pop((peer, rid), None) is not None:
                    self.stats.released += 1
            if answer:
                self.stats.rounds += 1
                reply = DraftReply(round=request.round, drafts=[d for d in drafts if d is not None])
                replies.append([peer, encode_reply(reply)])
            else:
                self.stats.superseded += 1
        seconds = self._seconds(work)
        self.stats.modelled_s += seconds
        return replies, seconds

    def _item(self, peer: bytes, item: DraftItem, answer: bool, work: _Work) -> DraftTokens | None:
        key = (peer, item.rid)
        self.stats.items += 1
        state = self._states.get(key)
        if item.full:
            state = self.model.start(item.sync_tokens)
            self._put(key, state)
        elif state is not None:
            self.model.sync(state, item.sync_tokens)
            self._states.move_to_end(key)
        if state is None or state.position != item.position:
            # unknown rid (restart, eviction) or a lost round: the target must send everything again
            self._states.pop(key, None)
            self.stats.resyncs += 1
            return DraftTokens(rid=item.rid, tokens=[], resync=True) if answer else None
        if item.sync_tokens:
            work.syncs.append((len(item.sync_tokens), item.position - len(item.sync_tokens)))
        if not answer:
            return None
        sampler = Sampler.from_params(
            SamplingParams(temperature=item.temperature, top_p=item.top_p, top_k=item.top_k), item.seed_base
        )
        proposal = self.model.propose(state, item.k, sampler, want_q=item.want_q)
        self.stats.drafted += len(proposal.tokens)
        work.drafts.append((item.position, len(proposal.tokens), bool(item.sync_tokens)))
        q_probs = None
        if proposal.q is not None:
            q_probs = [QDist(tokens=list(q.tokens), probs=list(q.probs)) for q in proposal.q]
        return DraftTokens(rid=item.rid, tokens=list(proposal.tokens), q_probs=q_probs)

    def _put(self, key: tuple[bytes, str], state: DraftState) -> None:
        self._states[key] = state
        self._states.move_to_end(key)
        while len(self._states) > self.max_states:
            self._states.popitem(last=False)
            self.stats.evicted += 1

    def _seconds(self, work: _Work) -> float:
        """First step: every synced id (yielding first drafts); then one decode step per draft position."""
        if self.cost is None:
            return 0.0
        first = StepWork(
            prefill=work.syncs, decode_contexts=[pos for pos, k, synced in work.drafts if k and not synced]
        )
        seconds = self.cost.step_time(first)
        k_max = max((k for _, k, _ in work.drafts), default=0)
        for j in range(1, k_max):
            seconds += self.cost.decode_step_time([pos + j for pos, k, _ in work.drafts if k > j])
        return seconds
