"""The data path (gateway -> worker): an SGLang-compatible `/generate` subset (DESIGN 4.2).

Lumen workers decode these strictly (unknown fields are rejected). The gateway only ever sends
token ids: it tokenizes itself because it must know the prompt ids to resume a request elsewhere.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

import msgspec

from gateway.protocol.versions import GENERATE_PROTOCOL_VERSION


class EngineKind(StrEnum):
    """What serves a worker's data path (`Hello.engine`)."""

    LUMEN = "lumen"  # Lumen's worker server: takes the `lumen` extension below
    SGLANG = "sglang"  # an unmodified SGLang server: gateway.protocol.sglang

    @classmethod
    def of(cls, hello_engine: str) -> EngineKind:
        return cls(hello_engine) if hello_engine else cls.LUMEN


class SamplingParams(msgspec.Struct, omit_defaults=True):
    """SGLang's sampling parameters; fields Lumen's engine does not implement are ignored (SGLang
    clients and gateways such as SMG send many)."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    # SGLang's wire convention: -1 disables top-k
    top_k: int = -1
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False


class HolderRef(msgspec.Struct, forbid_unknown_fields=True):
    worker_id: str
    kv_endpoint: str


class LumenExt(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """Lumen's extension, sent only to Lumen's own workers."""

    v: int = GENERATE_PROTOCOL_VERSION
    # the worker incarnation the gateway believes it talks to; a mismatch is refused (409)
    epoch: int = 0
    # token at absolute position p is sampled with an RNG seeded by (seed_base, p): replay-exact
    seed_base: int = 0
    checkpoint: list[HolderRef] = msgspec.field(default_factory=list)
    attempt: int = 0


class GenerateRequest(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Unknown top-level fields are ignored, as SGLang does; a missing rid gets one from the worker."""

    input_ids: list[int]
    rid: str = ""
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream: bool = True
    lumen: LumenExt | None = None


FinishType = Literal["length", "stop", "abort"]


class FinishReason(msgspec.Struct, omit_defaults=True):
    """SGLang's finish reason object: `{"type": "length", "length": n}` or `{"type": "stop", "matched": id}`
    (SGLang puts the matched stop string there when a string matched)."""

    type: FinishType
    length: int | None = None
    matched: int | str | None = None
    message: str | None = None


class MetaInfo(msgspec.Struct, omit_defaults=True):
    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    # Lumen additions
    restored_tokens: int = 0
    worker_id: str | None = None
    incarnation: int | None = None


class GenerateChunk(msgspec.Struct, omit_defaults=True):
    """One SSE `data:` payload. Lumen workers send only the new ids of each chunk; SGLang by default
    the cumulative ids (`new_output_ids` tells them apart), with `"text": null` until the last."""

    output_ids: list[int]
    meta_info: MetaInfo
    text: str | None = ""


class StreamError(Exception):
    """A `data: {"error": {...}}` chunk: the worker gave up on the request mid-stream."""

    def __init__(self, message: str, code: int | str | None) -> None:
        super().__init__(f"worker error mid-stream ({code}): {message}")
        self.message = message
        self.code = code


class _ErrorDetail(msgspec.Struct):
    message: str = ""
    code: int | str | None = None


class _StreamPayload(msgspec.Struct):
    """Any `data:` payload of a /generate stream: a chunk, or an error object."""

    output_ids: list[int] | None = None
    meta_info: MetaInfo | None = None
    text: str | None = None
    error: _ErrorDetail | None = None


def new_output_ids(chunk: GenerateChunk, received: int) -> list[int]:
    """The ids of `chunk` not received before on this stream, for either streaming form.

    A cumulative chunk (SGLang's default) carries every id so far, so its length is the request's
    `completion_tokens`; an incremental chunk (Lumen's workers, SGLang's
    `--incremental-streaming-output`) carries only new ids, fewer than `completion_tokens` once
    anything was received. The first chunk reads the same either way.
    """
    ids = chunk.output_ids
    if received and len(ids) == chunk.meta_info.completion_tokens and len(ids) >= received:
        return ids[received:]
    return ids


class ErrorBody(msgspec.Struct):
    message: str
    type: str
    code: int | str | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorBody


class AbortRequest(msgspec.Struct, forbid_unknown_fields=True):
    rid: str


SSE_DONE = b"data: [DONE]\n\n"

_chunk_encoder = msgspec.json.Encoder()
_payload_decoder = msgspec.json.Decoder(_StreamPayload)
request_decoder = msgspec.json.Decoder(GenerateRequest)


def encode_sse_chunk(chunk: GenerateChunk) -> bytes:
    return b"data: " + _chunk_encoder.encode(chunk) + b"\n\n"


def decode_chunk(payload: bytes) -> GenerateChunk:
    """One `data:` payload as a chunk. Raises StreamError for an error object and
    msgspec.ValidationError for anything else that is not a chunk."""
    p = _payload_decoder.decode(payload)
    if p.error is not None:
        raise StreamError(p.error.message, p.error.code)
    if p.output_ids is None or p.meta_info is None:
        raise msgspec.ValidationError("a chunk needs output_ids and meta_info")
    return GenerateChunk(p.output_ids, p.meta_info, p.text)


def encode(obj: object) -> bytes:
    return _chunk_encoder.encode(obj)
