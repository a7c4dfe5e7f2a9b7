"""The target's side of the draft-assist plane: a DEALER socket connected to one drafter.

Per decode step the target builds one `DraftItem` per request it wants drafts for (`sync_item`, which
tracks what the drafter has already been sent), sends them (`request`, never blocks), runs the rest of
its step, and collects the drafts (`poll`), waiting at most `draft_timeout`. Replies of older rounds are
dropped; a drafter that is down, slow or gone shows up as `poll` returning None, never as an exception.
Reconnection is ZMQ's business (`IMMEDIATE` keeps messages from queueing for a peer that is not there).

The client also keeps the pair's acceptance counts (`record`), which feed adaptive k and the metrics.

With a `PlaneAuth` the DEALER is a CURVE client: it presents this process's key and talks only to the
drafter whose server key it was given (StartDraftAssist's `peer_plane_key`). `PLAINTEXT`: tests only.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import structlog
import zmq
import zmq.asyncio

from draft_models.distribution import Dist
from gateway.protocol.draft import (
    MAX_K,
    DraftItem,
    DraftProtocolError,
    DraftRequest,
    DraftTokens,
    decode_reply,
    encode_request,
)
from gateway.protocol.planes import PlaneAuth, Security, curve_client
from gateway.protocol.zap import RetryRefused

log = structlog.get_logger("lumen.draft.assist")


@dataclass(frozen=True, slots=True)
class Draft:
    tokens: tuple[int, ...]
    q: tuple[Dist, ...] | None  # the proposal distributions, when asked for (`want_q`)


@dataclass(slots=True)
class AssistStats:
    pair: str
    rounds: int = 0  # requests sent
    unsent: int = 0  # requests the socket refused (no drafter connected, queue full)
    replies: int = 0  # replies in time for their round
    timeouts: int = 0
    stale: int = 0  # replies of an older round, dropped
    refused: int = 0  # malformed replies, dropped
    resyncs: int = 0
    verified_rounds: int = 0  # (request, round) verifications with at least one draft
    drafted: int = 0
    accepted: int = 0
    rejected: int = 0  # verifications that stopped at a rejected draft

    @property
    def acceptance(self) -> float | None:
        """Per-token acceptance rate a (DESIGN 4.5): accepted / drafts actually judged. Drafts after
        the first rejection are never judged, so accepted / drafted would understate a (for a = 0.7 and
        k = 4 it is about 0.44)."""
        judged = self.accepted + self.rejected
        return self.accepted / judged if judged else None

    @property
    def accepted_fraction(self) -> float | None:
        """accepted / drafted: the share of the drafter's work that was used."""
        return self.accepted / self.drafted if self.drafted else None


class DraftClient:
    def __init__(
        self,
        endpoint: str,
        *,
        auth: Security,
        server_key: str = "",
        pair: str = "",
        ctx: zmq.asyncio.Context | None = None,
        sndhwm: int = 64,
    ) -> None:
        """`server_key`: the drafter's CURVE key (needed with a PlaneAuth; ValueError without)."""
        self.endpoint = endpoint
        if isinstance(auth, PlaneAuth) and not server_key:
            raise ValueError(f"no CURVE server key for drafter {endpoint!r}")
        self._own_ctx = ctx is None
        self._ctx = ctx if ctx is not None else zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.DEALER)
        if isinstance(auth, PlaneAuth):
            try:
                curve_client(sock, auth.keys, server_key)
            except Exception as exc:
                sock.close(0)
                if self._own_ctx:
                    self._ctx.term()
                raise ValueError(str(exc)) from exc
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDHWM, sndhwm)
        sock.setsockopt(zmq.RECONNECT_IVL, 50)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sock.connect(endpoint)
        self._sock: zmq.asyncio.Socket | None = sock
        # CURVE: reconnect after a refused handshake (a drafter that had not heard of us yet)
        self._retry = RetryRefused(sock, endpoint) if isinstance(auth, PlaneAuth) else None
        # rid -> context length the drafter was last sent; absent: send the full context next
        self._sent: dict[str, int] = {}
        self._release: list[str] = []
        self._last_sent_round: int | None = None
        self.stats = AssistStats(pair=pair)

    def close(self) -> None:
        if self._retry is not None:
            self._retry.stop()
            self._retry = None
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        if self._own_ctx and not self._ctx.closed:
            self._ctx.term()

    # -- sync bookkeeping -----------------------------------------------------------------------
    def sync_item(
        self,
        rid: str,
        context: Sequence[int],
        k: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = -1,
        seed_base: int = 0,
        want_q: bool = False,
    ) -> DraftItem:
        """The item for `rid` whose context (prompt + accepted output) is `context`. Call it only for
        items passed to the next `request`: it records that the drafter now has this context."""
        if not 0 <= k <= MAX_K:
            raise ValueError(f"k must be in [0, {MAX_K}], got {k}")
        sent = self._sent.get(rid)
        full = sent is None or sent > len(context)
        sync = list(context) if full else list(context[sent:])
        self._sent[rid] = len(context)
        return DraftItem(
            rid=rid,
            sync_tokens=sync,
            position=len(context),
            k=k,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed_base=seed_base,
            full=full,
            want_q=want_q,
        )

    def forget(self, rid: str) -> None:
        """The request is done: its drafter state is released with the next request."""
        if self._sent.pop(rid, None) is not None:
            self._release.append(rid)

    # -- rounds ---------------------------------------------------------------------------------
    def request(self, round: int, items: Iterable[DraftItem]) -> None:
        """Send one round without waiting; a refused send is counted and its rids resync later."""
        batch = list(items)
        if self._sock is None:
            raise RuntimeError("DraftClient is closed")
        if len({item.rid for item in batch}) != len(batch):
            raise ValueError("a round carries each rid at most once")
        payload = encode_request(DraftRequest(round=round, batch=batch, release=self._release))
        sent = cast("asyncio.Future[object]", self._sock.send(payload, flags=zmq.NOBLOCK))
        # with NOBLOCK the future is already resolved; reading its exception marks it retrieved
        exc = sent.exception() if sent.done() else None
        if not sent.done():
            sent.cancel()
            exc = zmq.Again()
        if exc is not None:
            self.stats.unsent += 1
            self._last_sent_round = None
            for item in batch:
                self._sent.pop(item.rid, None)  # the drafter never saw this sync
            return
        self._release = []
        self._last_sent_round = round
        self.stats.rounds += 1

    async def poll(self, round: int, timeout_s: float) -> dict[str, Draft] | None:
        """The drafts of `round`, or None if they are not here within `timeout_s` (or were never sent)."""
        sock = self._sock
        if sock is None or self._last_sent_round != round:
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, timeout_s)
        while True:
            remaining_ms = math.floor((deadline - loop.time()) * 1000.0)
            if not await sock.poll(timeout=max(0, remaining_ms)):
                if remaining_ms <= 0:
                    self.stats.timeouts += 1
                    return None
                continue
            try:
                # never block: poll() said readable, but the peer may vanish in between
                frames = await sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                continue
            except zmq.ZMQError:  # closed under us (close() during a poll): no drafts this round
                return None
            drafts = self._accept(frames, round)
            if drafts is not None:
                return drafts

    def _accept(self, frames: list[bytes], round: int) -> dict[str, Draft] | None:
        if len(frames) != 1:
            self.stats.refused += 1
            log.warning("draft_reply_refused", reason=f"{len(frames)} frames, expected 1")
            return None
        try:
            reply = decode_reply(frames[0])
        except DraftProtocolError as exc:
            self.stats.refused += 1
            log.warning("draft_reply_refused", reason=str(exc))
            return None
        # a resync holds whatever the round: the drafter has lost that rid's state
        for d in reply.drafts:
            if d.resync:
                self.stats.resyncs += 1
                self._sent.pop(d.rid, None)
        if reply.round != round:
            self.stats.stale += 1
            return None
        try:
            drafts = {d.rid: self._draft(d) for d in reply.drafts if not d.resync}
        except ValueError as exc:  # a q that is not a distribution
            self.stats.refused += 1
            log.warning("draft_reply_refused", reason=str(exc))
            return None
        self.stats.replies += 1
        return drafts

    @staticmethod
    def _draft(d: DraftTokens) -> Draft:
        q = None
        if d.q_probs is not None:
            q = tuple(Dist(tuple(row.tokens), tuple(row.probs)) for row in d.q_probs)
        return Draft(tuple(d.tokens), q)

    # -- acceptance -----------------------------------------------------------------------------
    def record(self, drafted: int, accepted: int) -> None:
        """One request's verification: `accepted` of its `drafted` drafts were kept."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted {accepted} of {drafted} drafts")
        if drafted == 0:
            return
        self.stats.verified_rounds += 1
        self.stats.drafted += drafted
        self.stats.accepted += accepted
        self.stats.rejected += accepted < drafted
