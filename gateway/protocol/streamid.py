"""SSE event ids that let a client resume a broken stream on any gateway of the cluster.

Every streamed event carries `id: <position>`: where the stream stands after that event, per choice —
how many output ids the client's text already covers, whether the choice has ended, the seed base its
tokens are sampled with, and the worker attempt serving it (so another gateway can adopt the running
request instead of recomputing it). A client whose stream broke re-sends the same request with
`Last-Event-ID: <position>` to any gateway and gets exactly the rest of the stream.

A position is opaque to clients and tamper-proof: `base64url(msgpack payload) "." base64url(tag)`, the
tag an HMAC-SHA256 (truncated to 128 bits) under a key every gateway of the cluster derives from the
shared control token. The payload binds the position to a digest of the request body and of the
caller's API key, so it resumes only the request it came from, for the caller it was issued to. It is
integrity-protected, not encrypted: it holds worker ids and seeds, nothing secret.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac

import msgspec

STREAM_ID_VERSION = 1
_KEY_LABEL = b"lumen stream id v1"
_TAG_BYTES = 16
MAX_STREAM_ID_CHARS = 8192  # a longer Last-Event-ID is refused unread


class StreamIdError(ValueError):
    """A Last-Event-ID that is malformed, forged, from another cluster, request or caller."""


class ChoicePosition(msgspec.Struct, array_like=True, frozen=True):
    sent: int  # output ids whose text (and stop-string decision) the client has
    seed: int  # the choice's seed base (drawn by the gateway when the request had none)
    done: bool = False  # the choice's last event (with its finish reason) was sent
    worker: str = ""  # the worker serving the choice when the event was sent ("": none yet)
    wrid: str = ""  # the request's id on that worker
    epoch: int = 0  # that worker's incarnation


class StreamPosition(msgspec.Struct, array_like=True, frozen=True):
    v: int
    rid: str  # the response's id (`cmpl-…`): the resumed stream carries the same
    created: int  # the response's `created`
    request: str  # request_digest of the body
    caller: str  # caller_digest of the API key ("" without keys)
    choices: tuple[ChoicePosition, ...]
    closed: bool = False  # the closing events (usage) were sent: only [DONE] is left
    cached: int = 0  # the prompt's cached tokens the first attempt reported (usage details)


def stream_key(control_token: str) -> bytes:
    return hmac.new(control_token.encode(), _KEY_LABEL, hashlib.sha256).digest()


def request_digest(body: object) -> str:
    """A digest of the parsed request body, independent of key order and whitespace."""
    return hashlib.sha256(msgspec.json.encode(body, order="sorted")).hexdigest()[:32]


def caller_digest(api_key_id: str) -> str:
    return hashlib.sha256(api_key_id.encode()).hexdigest()[:16] if api_key_id else ""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _tag(key: bytes, payload: bytes) -> bytes:
    return hmac.new(key, payload, hashlib.sha256).digest()[:_TAG_BYTES]


def encode_position(key: bytes, pos: StreamPosition) -> str:
    payload = msgspec.msgpack.encode(pos)
    return f"{_b64(payload)}.{_b64(_tag(key, payload))}"


def decode_position(key: bytes, text: str, *, request: str, caller: str) -> StreamPosition:
    """The position in `text`, checked: its tag under `key`, its version, and that it belongs to
    this request body (`request`) and caller (`caller`). Raises StreamIdError."""
    if len(text) > MAX_STREAM_ID_CHARS:
        raise StreamIdError("Last-Event-ID is too long")
    body, sep, tag = text.strip().partition(".")
    try:
        payload, given = _unb64(body), _unb64(tag)
    except (binascii.Error, ValueError) as exc:
        raise StreamIdError("Last-Event-ID is not a stream position of this gateway") from exc
    if not sep or not hmac.compare_digest(given, _tag(key, payload)):
        raise StreamIdError("Last-Event-ID is not a stream position of this cluster")
    try:
        pos = msgspec.msgpack.decode(payload, type=StreamPosition)
    except msgspec.DecodeError as exc:  # signed by us, yet unreadable: another version's
        raise StreamIdError(f"Last-Event-ID has an unreadable position: {exc}") from exc
    if pos.v != STREAM_ID_VERSION:
        raise StreamIdError(f"Last-Event-ID has position version {pos.v}; this gateway reads {STREAM_ID_VERSION}")
    if not hmac.compare_digest(pos.request, request):
        raise StreamIdError("Last-Event-ID belongs to another request body: re-send the same request")
    if not hmac.compare_digest(pos.caller, caller):
        raise StreamIdError("Last-Event-ID was issued to another caller")
    return pos
