"""The data path (gateway -> worker): an SGLang-compatible `/generate` subset (DESIGN 4.2).

Lumen workers decode these strictly (unknown fields are rejected). The gateway only ever sends
token ids: it tokenizes itself because it must know the prompt ids to resume a request elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

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
    # > 0: when the gateway's connection drops before the end, the worker keeps the request running,
    # its output kept, this long for another gateway to adopt (`POST /lumen/adopt`), then aborts it.
    # 0: a dropped connection aborts the request at once. A gateway ends a request it gives up on
    # with /abort_request.
    orphan_grace_s: float = 0.0


class GenerateRequest(msgspec.Struct, omit_defaults=True, kw_only=True):
    """Unknown top-level fields are ignored, as SGLang does; a missing rid gets one from the worker.

    `return_logprob` asks for the log probability of every output token (`meta_info.
    output_token_logprobs`), `top_logprobs_num` > 0 also for that many most likely tokens at each
    position (`meta_info.output_top_logprobs`): SGLang's fields and shapes. Prompt logprobs
    (SGLang's `logprob_start_len`) are not part of the subset.
    """

    input_ids: list[int]
    rid: str = ""
    sampling_params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    stream: bool = True
    return_logprob: bool = False
    top_logprobs_num: int = 0
    lumen: LumenExt | None = None


FinishType = Literal["length", "stop", "abort"]


# the abort message of every request a Lumen worker drops when it becomes a new incarnation (fenced by
# a gateway): the incarnation the request was sent to is gone, whichever gateway sent it
INCARNATION_RESET_ABORT = "worker incarnation reset"


class FinishReason(msgspec.Struct, omit_defaults=True):
    """SGLang's finish reason object: `{"type": "length", "length": n}` or `{"type": "stop", "matched": id}`
    (SGLang puts the matched stop string there when a string matched)."""

    type: FinishType
    length: int | None = None
    matched: int | str | None = None
    message: str | None = None


# SGLang's logprob row: (logprob, token id, token text or null unless `return_text_in_logprobs`).
# A logprob SGLang could not represent (-inf, serialised by orjson as null) reads as None.
LogprobRow = tuple[float | None, int, str | None]


class MetaInfo(msgspec.Struct, omit_defaults=True):
    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    finish_reason: FinishReason | None = None
    # with `return_logprob`: one row per output id of the chunk (all ids so far in SGLang's default
    # cumulative streaming, the chunk's new ids in the incremental form), and with top_logprobs_num > 0
    # one list of that many rows per output id, most likely first
    # (srt/managers/tokenizer_manager.py `add_logprob_to_meta_info`, `_slice_streaming_output_meta_info`)
    output_token_logprobs: list[LogprobRow] = msgspec.field(default_factory=list)
    output_top_logprobs: list[list[LogprobRow] | None] = msgspec.field(default_factory=list)
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


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One output token's log probability and the most likely tokens at its position, (logprob, id)
    pairs, most likely first. A logprob is None where the worker sent none it could represent."""

    token_id: int
    logprob: float | None
    top: tuple[tuple[float | None, int], ...] = ()


def logprob_meta(logprobs: Sequence[TokenLogprob], top_n: int) -> dict[str, list[Any]]:
    """`output_token_logprobs` (and `output_top_logprobs` when top_n > 0) for these tokens, as a worker
    sends them in `meta_info` (texts null: `return_text_in_logprobs` is not part of the subset)."""
    meta: dict[str, list[Any]] = {"output_token_logprobs": [(t.logprob, t.token_id, None) for t in logprobs]}
    if top_n > 0:
        meta["output_top_logprobs"] = [[(lp, i, None) for lp, i in t.top] for t in logprobs]
    return meta


def token_logprobs(meta: MetaInfo, ids: Sequence[int]) -> tuple[TokenLogprob, ...]:
    """The logprobs of `ids`, the chunk's new output ids (after `incremental`), from its meta_info.

    Raises ValueError when the chunk carries fewer rows than ids or rows for other ids.
    """
    rows, tops = meta.output_token_logprobs, meta.output_top_logprobs
    if len(rows) != len(ids):
        raise ValueError(f"{len(ids)} new output ids but {len(rows)} logprob rows")
    if tops and len(tops) != len(ids):
        raise ValueError(f"{len(ids)} new output ids but {len(tops)} top-logprob rows")
    out = []
    for k, (token, (lp, rid, _text)) in enumerate(zip(ids, rows, strict=True)):
        if rid != token:
            raise ValueError(f"logprob row {k} is for token {rid}, the output id is {token}")
        top = tops[k] if tops else None
        out.append(TokenLogprob(token, lp, tuple((t[0], t[1]) for t in top) if top else ()))
    return tuple(out)


def incremental(chunk: GenerateChunk, received: int) -> GenerateChunk:
    """`chunk` with only what was not received before on this stream: its new output ids and, when it
    carries logprobs, their rows. `received` counts the ids received so far on this stream.

    SGLang's default streaming repeats every id so far, and with `return_logprob` every logprob row
    so far too (`add_logprob_to_meta_info` reports the request's whole lists; only
    `--incremental-streaming-output` slices them per chunk), so ids and rows are cut at the same
    offset. Returns `chunk` itself when it is already incremental.
    """
    ids = new_output_ids(chunk, received)
    if ids is chunk.output_ids:
        return chunk
    meta = chunk.meta_info
    cut = len(chunk.output_ids) - len(ids)
    if meta.output_token_logprobs or meta.output_top_logprobs:
        meta = msgspec.structs.replace(
            meta,
            output_token_logprobs=meta.output_token_logprobs[cut:],
            output_top_logprobs=meta.output_top_logprobs[cut:],
        )
    return GenerateChunk(ids, meta, chunk.text)


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
    """`POST /abort_request` on a Lumen worker: SGLang's body (`protocol.sglang.SGLangAbort`, what the
    gateway sends every worker): every request whose rid starts with `rid`, or all with `abort_all`."""

    rid: str
    abort_all: bool = False


class AdoptRequest(msgspec.Struct, forbid_unknown_fields=True):
    """`POST /lumen/adopt` on a Lumen worker: take over a request whose gateway went away (still in
    its orphan grace). The answer is the request's stream from its first output id: one chunk with
    every id so far, then the rest as it comes. 404 when the worker no longer has it."""

    rid: str
    epoch: int = 0  # the incarnation the adopting gateway believes the request runs on; 0: any


class SeedSend(msgspec.Struct, forbid_unknown_fields=True):
    """`POST /lumen/seed_send` on a Lumen worker: a restarting peer loads its weights from this one
    (seeded reload, worker_hooks/engine/seeding.py). The seed's steps take `slowdown` x longer for
    `seconds` (wall), the modelled cost of sending; the answer comes when the transfer ends, and a
    broken connection tells the restart that its seed is gone."""

    seconds: float
    slowdown: float


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
