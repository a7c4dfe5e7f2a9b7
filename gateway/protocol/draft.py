"""The draft-assist plane (DESIGN 4.5): ZMQ DEALER (target) <-> ROUTER (drafter).

One msgpack frame per message. The target sends a `DraftRequest` per round: for each request it wants
drafts for, the ids accepted since its previous round for that rid (`sync_tokens`), or the whole context
when `full` is set (the first round, or after the drafter asked for a resync), plus `position` (the
context length after the sync: the drafter checks its own state against it) and how many drafts (`k`).
The drafter answers with one `DraftReply` carrying the same `round`; the target drops replies of older
rounds. A drafter that lost a request's state (restart, eviction, a lost message) answers `resync` and
no tokens; the target then sends the full context in its next round.

`q_probs` carries, per draft token, the drafter's whole proposal distribution q over its (small) support:
speculative rejection sampling needs q(x) for the acceptance test and all of q for the residual
`norm(max(0, p - q))` when a draft is rejected. It is sent only when the target asks (`want_q`).
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

from gateway.protocol.versions import DRAFT_PROTOCOL_VERSION

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Prob = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
# bounds that keep a hostile message from asking for absurd work
MAX_K: Final = 64
MAX_BATCH: Final = 4096
MAX_RID_LEN: Final = 256
Rid = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_RID_LEN)]
DraftCount = Annotated[int, msgspec.Meta(ge=0, le=MAX_K)]


class DraftProtocolError(ValueError):
    """A draft-plane message that cannot be accepted: wrong version, malformed, inconsistent."""


class DraftItem(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    rid: Rid
    # ids accepted since this rid's previous round, or the whole context when `full`
    sync_tokens: list[NonNeg]
    # context length once sync_tokens are absorbed (= absolute position of the first draft)
    position: NonNeg
    k: DraftCount
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: int = -1  # SGLang's convention: -1 disables
    seed_base: int = 0
    full: bool = False
    want_q: bool = False  # the target verifies by rejection sampling and needs q


# the envelopes always encode `v` (no omit_defaults): it is read before the schema is
class DraftRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    round: NonNeg
    batch: list[DraftItem]
    # rids the target is done with: the drafter frees their state
    release: list[Rid] = msgspec.field(default_factory=list)
    v: int = DRAFT_PROTOCOL_VERSION


class QDist(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One proposal distribution: `probs[i]` is q(`tokens[i]`); tokens absent from the list have q = 0."""

    tokens: list[NonNeg]
    probs: list[Prob]


class DraftTokens(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    rid: Rid
    tokens: list[NonNeg]
    q_probs: list[QDist] | None = None
    resync: bool = False  # the drafter has no state for rid: send the full context next round


class DraftReply(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    round: NonNeg
    drafts: list[DraftTokens]
    v: int = DRAFT_PROTOCOL_VERSION


class _Version(msgspec.Struct):
    """Read first, on its own, so a peer of another version gets a version error, not a schema one."""

    v: int


_encoder = msgspec.msgpack.Encoder()
_version_decoder = msgspec.msgpack.Decoder(_Version)
_request_decoder = msgspec.msgpack.Decoder(DraftRequest)
_reply_decoder = msgspec.msgpack.Decoder(DraftReply)


def _check_version(buf: bytes | memoryview, what: str) -> None:
    try:
        version = _version_decoder.decode(buf).v
    except msgspec.DecodeError as exc:
        raise DraftProtocolError(f"malformed {what}: {exc}") from exc
    if version != DRAFT_PROTOCOL_VERSION:
        raise DraftProtocolError(
            f"draft protocol version {version} is not supported (this side speaks {DRAFT_PROTOCOL_VERSION})"
        )


def encode_request(request: DraftRequest) -> bytes:
    return _encoder.encode(request)


def encode_reply(reply: DraftReply) -> bytes:
    return _encoder.encode(reply)


def decode_request(buf: bytes | memoryview) -> DraftRequest:
    """Decode and validate one request; a wrong version or a bad message raises DraftProtocolError."""
    _check_version(buf, "draft request")
    try:
        request = _request_decoder.decode(buf)
    except msgspec.DecodeError as exc:
        raise DraftProtocolError(f"malformed draft request: {exc}") from exc
    if len(request.batch) > MAX_BATCH:
        raise DraftProtocolError(f"batch of {len(request.batch)} items exceeds {MAX_BATCH}")
    seen: set[str] = set()
    for item in request.batch:
        if item.rid in seen:
            raise DraftProtocolError(f"rid {item.rid!r} appears twice in one round")
        seen.add(item.rid)
        if item.full and len(item.sync_tokens) != item.position:
            raise DraftProtocolError(
                f"rid {item.rid!r}: a full sync of {len(item.sync_tokens)} ids at position {item.position}"
            )
        if len(item.sync_tokens) > item.position:
            raise DraftProtocolError(
                f"rid {item.rid!r}: {len(item.sync_tokens)} sync ids exceed position {item.position}"
            )
    return request


def decode_reply(buf: bytes | memoryview) -> DraftReply:
    """Decode and validate one reply; a wrong version or a bad message raises DraftProtocolError."""
    _check_version(buf, "draft reply")
    try:
        reply = _reply_decoder.decode(buf)
    except msgspec.DecodeError as exc:
        raise DraftProtocolError(f"malformed draft reply: {exc}") from exc
    for d in reply.drafts:
        if len(d.tokens) > MAX_K:
            raise DraftProtocolError(f"rid {d.rid!r}: {len(d.tokens)} drafts exceed {MAX_K}")
        if d.q_probs is None:
            continue
        if len(d.q_probs) != len(d.tokens):
            raise DraftProtocolError(f"rid {d.rid!r}: {len(d.q_probs)} q rows for {len(d.tokens)} drafts")
        for q in d.q_probs:
            if len(q.tokens) != len(q.probs):
                raise DraftProtocolError(f"rid {d.rid!r}: q has {len(q.tokens)} ids, {len(q.probs)} probs")
    return reply
