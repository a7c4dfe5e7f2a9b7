"""Resumable streams on the client API: an SSE `id:` on every event, and `Last-Event-ID` honoured.

Each event's id is the stream's position after it (gateway/protocol/streamid.py): per choice the
output ids the client's text covers, whether it ended, its seed base and the worker attempt serving
it. A client whose stream broke re-sends the same body with `Last-Event-ID` to any gateway of the
cluster; the handler rebuilds the request's choices from the position — same response id and
`created`, same seeds, each choice told what the client has (`Resumed`) and which attempt to adopt —
and `respond` writes only what comes after. Seeds are drawn here for every streamed choice without
one, so a replay on any gateway samples the same tokens.

Only the id of the last event of a step carries the step's position (a break between two events of
one step then repeats the first, a chat role chunk, rather than losing the second).
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass

from gateway.protocol.streamid import (
    ChoiceStep,
    PositionSigner,
    StreamIdError,
    StreamPosition,
    caller_digest,
    decode_position,
    request_digest,
)
from gateway.server.api.errors import InvalidRequest
from gateway.server.api.generation import Generation, Resumed, Step
from gateway.server.api.jobs import Attempt

LAST_EVENT_ID = "Last-Event-ID"


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """A checked Last-Event-ID: what the resumed response must reproduce and skip."""

    position: StreamPosition

    @property
    def rid(self) -> str:
        return self.position.rid

    @property
    def created(self) -> int:
        return self.position.created

    def seed(self, index: int) -> int:
        return self.position.choices[index].seed

    def resumed(self, index: int) -> Resumed:
        c = self.position.choices[index]
        return Resumed(sent=c.sent, done=c.done, cached_tokens=self.position.cached if index == 0 else 0)

    def adopt(self, index: int) -> Attempt | None:
        c = self.position.choices[index]
        return Attempt(c.worker, c.wrid, c.epoch) if c.worker and not c.done else None


def resume_point(
    header: str | None,
    key: bytes,
    body: dict[str, object],
    caller: str,
    n: int,
    stream: bool,
    *,
    ttl_s: float = math.inf,
    now: float | None = None,
) -> ResumePoint | None:
    """The request's resume point, or None for a fresh request. A Last-Event-ID that is forged, from
    another cluster, request or caller, on a request that does not stream, or older than `ttl_s`
    (recovery.resume_ttl_s, from its response's `created`), is a 400."""
    if header is None:
        return None
    if not stream:
        raise InvalidRequest(
            f"{LAST_EVENT_ID} resumes a stream: the request must have stream: true", param=LAST_EVENT_ID
        )
    try:
        pos = decode_position(key, header, request=request_digest(body), caller=caller_digest(caller))
    except StreamIdError as exc:
        raise InvalidRequest(str(exc), param=LAST_EVENT_ID, code="invalid_last_event_id") from exc
    age = (time.time() if now is None else now) - pos.created
    if age > ttl_s:
        raise InvalidRequest(
            f"{LAST_EVENT_ID} has expired: its stream started {age:.0f} s ago, resumes are taken for "
            f"{ttl_s:g} s (recovery.resume_ttl_s); send the request anew",
            param=LAST_EVENT_ID,
            code="expired_last_event_id",
        )
    if len(pos.choices) != n:
        raise InvalidRequest(
            f"{LAST_EVENT_ID} has {len(pos.choices)} choices, the request {n}", param=LAST_EVENT_ID
        )
    return ResumePoint(pos)


def draw_seed() -> int:
    return secrets.randbits(63)


class StreamIds:
    """Positions for one streamed response, event by event (signed by one `PositionSigner`)."""

    def __init__(
        self,
        key: bytes,
        body: dict[str, object],
        caller: str,
        rid: str,
        created: int,
        gens: list[Generation],
        resumed: ResumePoint | None = None,
    ) -> None:
        seeds = tuple(g.job.sampling.seed or 0 for g in gens)
        self._signer = PositionSigner(key, rid, created, request_digest(body), caller_digest(caller), seeds)
        self._gens = gens
        p = resumed.position if resumed is not None else None
        # per choice (sent, done, worker, wrid, epoch): what its next id says
        self._steps: list[ChoiceStep] = (
            [(c.sent, c.done, c.worker, c.wrid, c.epoch) for c in p.choices]
            if p
            else [(0, False, "", "", 0)] * len(gens)
        )
        self.closed = p.closed if p else False
        # per choice: ids of steps whose text is held back, not yet in its `sent` (see `step`)
        self._held = [0] * len(gens)

    def step(self, index: int, step: Step) -> None:
        """Count a step sent on; replayed steps were counted before the break.

        A step whose text is held back (a byte that ends no character, a possible stop string) writes
        no text, and its logprobs wait for the next chunk with text (envelopes.py). Its ids count once
        that chunk is sent, with it: a position never covers a token whose logprob the client lacks
        (another choice's event, or a chat role chunk, may carry an id meanwhile). While a choice has
        sent no text at all its held ids count at once (the client has nothing of it but, in chat, its
        role chunk, and a replay of them releases no text, so their logprobs are all sent after it)."""
        if step.replay:
            return
        sent, done, worker, wrid, epoch = self._steps[index]
        a = step.attempt
        if a is not None:
            worker, wrid, epoch = a.worker_id, a.wrid, a.epoch
        if step.text or step.finish is not None or sent == 0:
            sent += self._held[index] + len(step.ids)
            self._held[index] = 0
        else:
            self._held[index] += len(step.ids)
        self._steps[index] = (sent, done or step.finish is not None, worker, wrid, epoch)

    def position(self, *, closed: bool = False) -> str:
        return self._signer.sign(tuple(self._steps), closed=closed, cached=self._gens[0].cached_tokens)
