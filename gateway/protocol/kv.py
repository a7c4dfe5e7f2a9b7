"""The KV checkpoint plane (DESIGN 4.4): ZMQ PUSH (serving worker) -> PULL (holder's store).

Every message is two frames: a msgpack header (`KvHeader`) and one payload frame of raw page bytes,
sent and received zero-copy. PAGES carries `n_pages` full pages starting at page index `first_page`
of request `rid`, their token ids, and `page_bytes` bytes per page (payload = n_pages·page_bytes).
END (the request finished) and DROP (the checkpoint is abandoned or cancelled) carry an empty payload
and free the request's pages at the holder.

`parent_key` is the key of the page before `first_page` (or the namespace seed for page 0); None
means "continue the chain the holder already has for rid" (or start at the root for page 0), so the
serving side never has to hash on its decode path. The holder recomputes every page key from the
token ids (`gateway.protocol.pagekeys`), so keys are never trusted from the wire.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Annotated, Final

import msgspec

from gateway.protocol.pagekeys import is_key
from gateway.protocol.versions import KV_PROTOCOL_VERSION

NonNeg = Annotated[int, msgspec.Meta(ge=0)]
# bounds that keep a hostile header from asking for absurd allocations
# tokens per KV page: the default of every engine, store, config and scenario (a worker reports its own)
DEFAULT_PAGE_SIZE: Final = 64
MAX_PAGES_PER_MESSAGE: Final = 1 << 16
MAX_PAGE_SIZE: Final = 1 << 16


class KvProtocolError(ValueError):
    """A KV-plane message that cannot be accepted: wrong version, malformed, inconsistent."""


class KvType(enum.Enum):
    PAGES = "PAGES"
    END = "END"
    DROP = "DROP"


class KvHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    type: KvType
    rid: str
    src_worker: str
    incarnation: NonNeg
    first_page: NonNeg = 0
    n_pages: NonNeg = 0
    page_size: NonNeg = 0
    token_ids: list[NonNeg] = msgspec.field(default_factory=list)
    parent_key: str | None = None
    dtype: str = "uint8"
    # layout of one page, e.g. [layers, 2, page_size, kv_heads, head_dim]; informative for the store
    shape: list[NonNeg] = msgspec.field(default_factory=list)
    page_bytes: NonNeg = 0
    v: int = KV_PROTOCOL_VERSION

    @property
    def payload_bytes(self) -> int:
        return self.n_pages * self.page_bytes


class _Version(msgspec.Struct):
    """Read first, on its own, so a peer of another version gets a version error, not a schema one."""

    v: int


_encoder = msgspec.msgpack.Encoder()
_version_decoder = msgspec.msgpack.Decoder(_Version)
_header_decoder = msgspec.msgpack.Decoder(KvHeader)


def pages_header(
    *,
    rid: str,
    src_worker: str,
    incarnation: int,
    first_page: int,
    page_size: int,
    token_ids: list[int],
    page_bytes: int,
    parent_key: str | None = None,
    dtype: str = "uint8",
    shape: list[int] | None = None,
) -> KvHeader:
    n_pages = len(token_ids) // page_size if page_size else 0
    return KvHeader(
        type=KvType.PAGES,
        rid=rid,
        src_worker=src_worker,
        incarnation=incarnation,
        first_page=first_page,
        n_pages=n_pages,
        page_size=page_size,
        token_ids=token_ids,
        parent_key=parent_key,
        dtype=dtype,
        shape=shape if shape is not None else [page_bytes],
        page_bytes=page_bytes,
    )


def control_header(kind: KvType, *, rid: str, src_worker: str, incarnation: int) -> KvHeader:
    if kind is KvType.PAGES:
        raise ValueError("control_header builds END or DROP; use pages_header for PAGES")
    return KvHeader(type=kind, rid=rid, src_worker=src_worker, incarnation=incarnation)


def encode_header(header: KvHeader) -> bytes:
    return _encoder.encode(header)


def validate(header: KvHeader, payload_len: int) -> None:
    """Raise KvProtocolError unless the header is self-consistent and matches the payload length."""
    if not header.rid:
        raise KvProtocolError("empty rid")
    if header.type is not KvType.PAGES:
        if payload_len:
            raise KvProtocolError(f"{header.type.value} must carry an empty payload, got {payload_len} B")
        return
    if not 1 <= header.page_size <= MAX_PAGE_SIZE:
        raise KvProtocolError(f"page_size {header.page_size} outside [1, {MAX_PAGE_SIZE}]")
    if not 1 <= header.n_pages <= MAX_PAGES_PER_MESSAGE:
        raise KvProtocolError(f"n_pages {header.n_pages} outside [1, {MAX_PAGES_PER_MESSAGE}]")
    if len(header.token_ids) != header.n_pages * header.page_size:
        raise KvProtocolError(
            f"{len(header.token_ids)} token ids for {header.n_pages} pages of {header.page_size}"
        )
    if header.page_bytes < 1:
        raise KvProtocolError("page_bytes must be >= 1")
    if payload_len != header.payload_bytes:
        raise KvProtocolError(
            f"payload is {payload_len} B, header says {header.n_pages} x {header.page_bytes} B"
        )
    if header.parent_key is not None and not is_key(header.parent_key):
        raise KvProtocolError(f"parent_key is not a page key: {header.parent_key[:80]!r}")


def decode_header(buf: bytes | memoryview) -> KvHeader:
    """Decode one header frame; a wrong version or a malformed header raises KvProtocolError."""
    try:
        version = _version_decoder.decode(buf).v
    except msgspec.DecodeError as exc:
        raise KvProtocolError(f"malformed KV header: {exc}") from exc
    if version != KV_PROTOCOL_VERSION:
        raise KvProtocolError(
            f"KV protocol version {version} is not supported (this side speaks {KV_PROTOCOL_VERSION})"
        )
    try:
        return _header_decoder.decode(buf)
    except msgspec.DecodeError as exc:
        raise KvProtocolError(f"malformed KV header: {exc}") from exc


def encode(header: KvHeader, payload: bytes | memoryview = b"") -> list[bytes | memoryview]:
    """The two frames of one message; the payload is passed through untouched (zero-copy)."""
    return [encode_header(header), payload]


def decode(frames: Sequence[bytes | memoryview]) -> tuple[KvHeader, memoryview]:
    """Header and a flat byte view of the payload of one received message, validated."""
    if len(frames) != 2:
        raise KvProtocolError(f"a KV message has 2 frames, got {len(frames)}")
    header = decode_header(frames[0])
    payload = memoryview(frames[1])
    if payload.ndim != 1 or payload.format != "B":
        payload = payload.cast("B")
    validate(header, payload.nbytes)
    return header, payload
