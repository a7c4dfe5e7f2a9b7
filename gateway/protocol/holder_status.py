"""The holder-status socket of an SGLang server's holder stores (docs/sglang.md, "Storage backend").

Lumen's page store runs a holder store inside each SGLang scheduler rank, out of the sidecar agent's
reach; next to it, each rank answers a local ZMQ REP socket (`worker_hooks.sglang.local_holder`,
`status_endpoint`) so the agent can report the store in its heartbeats as Lumen's own workers do.

One request frame, one answer frame, both msgpack. The agent sends `HolderStatusRequest`; the store
answers `HolderStatus`: its bytes used, tokens held, and the durable tokens of each request it holds,
keyed by the rid the pages were filed under (for an SGLang serving server, `sglang_rid(attempt rid)`,
the plugin's `message_id`). An answer lists at most `min(max_requests, MAX_STATUS_REQUESTS)`
requests (the oldest held first) and says `truncated` when it left some out: a reader must then not
take a request missing from it as released. A request of another `version`, or one that does not
decode, is answered with `error` set and nothing else.
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

HOLDER_STATUS_VERSION: Final = 1
MAX_STATUS_REQUESTS: Final = 1 << 15  # requests one answer lists at most (~2 MiB of msgpack)

NonNeg = Annotated[int, msgspec.Meta(ge=0)]


class HolderStatusRequest(msgspec.Struct, kw_only=True):
    version: int = HOLDER_STATUS_VERSION
    max_requests: Annotated[int, msgspec.Meta(ge=0)] = MAX_STATUS_REQUESTS


class HolderStatus(msgspec.Struct, kw_only=True):
    version: int = HOLDER_STATUS_VERSION
    error: str = ""  # set: the request was refused and nothing else is filled in
    shard: NonNeg = 0  # the rank's store (`ShardLayout.own`)
    budget_bytes: NonNeg = 0
    bytes_used: NonNeg = 0
    tokens_held: NonNeg = 0
    requests: NonNeg = 0  # requests held (durable may list fewer)
    durable: dict[str, NonNeg] = msgspec.field(default_factory=dict)  # rid -> durable tokens
    truncated: bool = False  # durable leaves out some held requests


_request_decoder = msgspec.msgpack.Decoder(HolderStatusRequest)
_status_decoder = msgspec.msgpack.Decoder(HolderStatus)
_encoder = msgspec.msgpack.Encoder()


def encode(msg: HolderStatusRequest | HolderStatus) -> bytes:
    return _encoder.encode(msg)


def decode_request(data: bytes | memoryview) -> HolderStatusRequest | str:
    """The request, or the error to answer with."""
    try:
        req = _request_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return f"bad holder status request: {exc}"[:200]
    if req.version != HOLDER_STATUS_VERSION:
        return f"holder status version {req.version} unsupported (this store speaks {HOLDER_STATUS_VERSION})"
    return req


def decode_status(data: bytes | memoryview) -> HolderStatus:
    """An answer; raises ValueError when malformed, of another version or refused."""
    try:
        status = _status_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"bad holder status answer: {exc}") from exc
    if status.error:
        raise ValueError(f"holder status refused: {status.error}")
    if status.version != HOLDER_STATUS_VERSION:
        raise ValueError(f"holder status version {status.version} unsupported")
    return status
