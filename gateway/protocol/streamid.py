"""SSE event ids that let a client resume a broken stream on any gateway of the cluster.

Resumable streams are asked for: a request with the header `Lumen-Resumable: 1` (`RESUMABLE_HEADER`;
also any request carrying `Last-Event-ID`), a caller whose API key is listed in
`gateway.resumable_keys`, or every stream with `gateway.resumable_streams = true`. Any other stream is
framed exactly as SGLang and OpenAI servers frame it (`data:` lines and blank lines only), which
clients that parse SSE line by line (`python -m sglang.bench_serving`) need.

Every event of a resumable stream carries `id: <position>`: where the stream stands after that event, per choice —
how many output ids the client's text already covers, whether the choice has ended, the seed base its
tokens are sampled with, and the worker attempt serving it (so another gateway can adopt the running
request instead of recomputing it). A client whose stream broke re-sends the same request with
`Last-Event-ID: <position>` to any gateway and gets exactly the rest of the stream.

A position is opaque to clients and tamper-proof: `base64url(head) "." base64url(step) "." tag`. The
head (msgpack: version, response id and `created`, the request and caller digests, the seeds) is the
same for every event of a stream and encoded once; the step (msgpack: per choice the ids sent, ended,
worker attempt; closed; cached tokens) is what moves. The tag is a keyed BLAKE2b-128 (hex) over both,
under a key every gateway of the cluster derives from the shared control token; the head is hashed
once per stream and the hash state copied per event (`PositionSigner`), so an event's id costs one
small msgpack encoding and a copy of the hash state. The head binds the position to a digest of the
request body and of the caller's API key, so it resumes only the request it came from, for the caller
it was issued to. It is integrity-protected, not encrypted: it holds worker ids and seeds, nothing
secret.

Version 2 (this format) replaced version 1 (one msgpack payload under HMAC-SHA256): a version-1 id
from before an upgrade is refused (400, `invalid_last_event_id`); the client starts the request anew.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import struct

import msgspec

STREAM_ID_VERSION = 2
_KEY_LABEL = b"lumen stream id v2"
_PERSON = b"lumen-sid-v2"
_TAG_BYTES = 16
MAX_STREAM_ID_CHARS = 8192  # a longer Last-Event-ID is refused unread
# the request header a client sends to get a resumable stream (`id:` lines, keep-alive comments)
RESUMABLE_HEADER = "Lumen-Resumable"
RESUMABLE_HEADERS = {RESUMABLE_HEADER: "1"}  # what Lumen's own clients send
_YES = frozenset({"1", "true", "yes", "on"})


def asks_resumable(value: str | None) -> bool:
    """Whether a `Lumen-Resumable` header value asks for a resumable stream (1, true, yes, on)."""
    return value is not None and value.strip().lower() in _YES


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


# the wire form: what is fixed for a stream, and what moves event by event
class _Head(msgspec.Struct, array_like=True, frozen=True):
    v: int
    rid: str
    created: int
    request: str
    caller: str
    seeds: tuple[int, ...]


class _ChoiceStep(msgspec.Struct, array_like=True, frozen=True):
    sent: int
    done: bool
    worker: str
    wrid: str
    epoch: int


class _Step(msgspec.Struct, array_like=True, frozen=True):
    closed: bool
    cached: int
    choices: tuple[_ChoiceStep, ...]


# one choice's moving part as `PositionSigner.sign` takes it: (sent, done, worker, wrid, epoch)
ChoiceStep = tuple[int, bool, str, str, int]

_encode = msgspec.msgpack.Encoder().encode
_head_decoder = msgspec.msgpack.Decoder(_Head)
_step_decoder = msgspec.msgpack.Decoder(_Step)


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
    data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    if _b64(data) != text:  # one spelling per position: no other character decodes to the same
        raise ValueError("not canonical base64url")
    return data


def _head_hash(key: bytes, head: bytes) -> hashlib.blake2b:
    h = hashlib.blake2b(key=key, digest_size=_TAG_BYTES, person=_PERSON)
    h.update(struct.pack(">I", len(head)))  # where the head ends and the step begins
    h.update(head)
    return h


class PositionSigner:
    """The ids of one stream: its head encoded and hashed once, each event's step signed on a copy."""

    __slots__ = ("_hash", "_prefix")

    def __init__(
        self, key: bytes, rid: str, created: int, request: str, caller: str, seeds: tuple[int, ...]
    ) -> None:
        head = _encode(_Head(STREAM_ID_VERSION, rid, created, request, caller, seeds))
        self._hash = _head_hash(key, head)
        self._prefix = _b64(head) + "."

    def sign(self, choices: tuple[ChoiceStep, ...], *, closed: bool = False, cached: int = 0) -> str:
        step = _encode((closed, cached, choices))
        h = self._hash.copy()
        h.update(step)
        return f"{self._prefix}{_b64(step)}.{h.hexdigest()}"


def encode_position(key: bytes, pos: StreamPosition) -> str:
    """`pos` as an id (what `PositionSigner` gives for it)."""
    signer = PositionSigner(
        key, pos.rid, pos.created, pos.request, pos.caller, tuple(c.seed for c in pos.choices)
    )
    steps = tuple((c.sent, c.done, c.worker, c.wrid, c.epoch) for c in pos.choices)
    return signer.sign(steps, closed=pos.closed, cached=pos.cached)


def decode_position(key: bytes, text: str, *, request: str, caller: str) -> StreamPosition:
    """The position in `text`, checked: its tag under `key`, its version, and that it belongs to
    this request body (`request`) and caller (`caller`). Raises StreamIdError."""
    pos = read_position(key, text)
    if not hmac.compare_digest(pos.request, request):
        raise StreamIdError("Last-Event-ID belongs to another request body: re-send the same request")
    if not hmac.compare_digest(pos.caller, caller):
        raise StreamIdError("Last-Event-ID was issued to another caller")
    return pos


def read_position(key: bytes, text: str) -> StreamPosition:
    """The position in `text` if its tag verifies under `key` and its version is this one (not
    checked: which request and caller it belongs to; `decode_position` does). Raises StreamIdError."""
    if len(text) > MAX_STREAM_ID_CHARS:
        raise StreamIdError("Last-Event-ID is too long")
    parts = text.strip().split(".")
    if len(parts) != 3:
        raise StreamIdError(
            f"Last-Event-ID is not a stream position of this gateway (version {STREAM_ID_VERSION})"
        )
    try:
        head, step = _unb64(parts[0]), _unb64(parts[1])
        given = binascii.unhexlify(parts[2])
    except (binascii.Error, ValueError) as exc:
        raise StreamIdError("Last-Event-ID is not a stream position of this gateway") from exc
    h = _head_hash(key, head)
    h.update(step)
    if parts[2] != parts[2].lower() or not hmac.compare_digest(given, h.digest()):
        raise StreamIdError("Last-Event-ID is not a stream position of this cluster")
    try:
        hd, st = _head_decoder.decode(head), _step_decoder.decode(step)
    except msgspec.DecodeError as exc:  # signed by us, yet unreadable: another version's
        raise StreamIdError(f"Last-Event-ID has an unreadable position: {exc}") from exc
    if hd.v != STREAM_ID_VERSION:
        raise StreamIdError(
            f"Last-Event-ID has position version {hd.v}; this gateway reads {STREAM_ID_VERSION}"
        )
    if len(st.choices) != len(hd.seeds):
        raise StreamIdError("Last-Event-ID has an unreadable position: choices and seeds differ")
    choices = tuple(
        ChoicePosition(c.sent, seed, c.done, c.worker, c.wrid, c.epoch)
        for c, seed in zip(st.choices, hd.seeds, strict=True)
    )
    return StreamPosition(hd.v, hd.rid, hd.created, hd.request, hd.caller, choices, st.closed, st.cached)
