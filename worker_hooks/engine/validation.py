"""Admission checks on a /generate request: what the engine refuses before anything changes.

`check_body` runs on the raw body before it is decoded: the `sampling_params` go through the gateway's
own /generate parsing (gateway.protocol.openai.requests.parse_sampling_params, with the keys this
worker honours), so an unknown key, an SGLang key the worker does not honour at a non-neutral value,
or a value out of range is refused with a 400 in OpenAI's error shape naming `sampling_params.<key>`,
as on the gateway. `validate` checks the decoded request (also when submitted in process).
"""

from __future__ import annotations

from typing import Any

import msgspec

from gateway.protocol.generate import GenerateRequest, SamplingParams
from gateway.protocol.openai.errors import InvalidRequest
from gateway.protocol.openai.fields import Fields
from gateway.protocol.openai.requests import Bounds, parse_sampling_params
from gateway.protocol.openai.sampling import HONOURED_BY_WORKER
from worker_hooks.engine import errors
from worker_hooks.engine.checkpointing import valid_endpoint


class _Sampling(msgspec.Struct):
    sampling_params: Any = None


_sampling_decoder = msgspec.json.Decoder(_Sampling)


def check_body(body: bytes, vocab_size: int) -> None:
    """Refuse (OpenAIError, 400) a body with invalid UTF-8, or whose `sampling_params` the worker would
    not honour exactly. Anything else (not JSON, not an object, other fields) is left to the body's
    decoding and `validate`."""
    try:
        raw = _sampling_decoder.decode(body).sampling_params
    except UnicodeDecodeError as exc:  # msgspec raises it for invalid UTF-8 inside a string
        raise InvalidRequest(
            f"invalid /generate body: not valid UTF-8 ({exc.reason} at byte {exc.start})", code="invalid_json"
        ) from exc
    except (msgspec.DecodeError, msgspec.ValidationError):
        return  # not an object, or not JSON: the full decode names it
    bounds = Bounds(
        model="",
        vocab_size=vocab_size,
        default_max_tokens=SamplingParams().max_new_tokens,
        max_new_tokens=None,
        min_new_tokens=0,
        max_top_k=None,
    )
    # the gateway's stop ids are its request's (<= 256) plus the tokenizer's EOS ids: no count limit
    fields = Fields({"sampling_params": raw})
    parse_sampling_params(fields, bounds, honoured=HONOURED_BY_WORKER, max_stop_token_ids=None)


def validate(req: GenerateRequest, vocab_size: int) -> None:
    """Raise MalformedRequest naming the first field that is out of range."""
    p = req.sampling_params
    if not req.rid:
        raise errors.MalformedRequest("rid must be a non-empty string")
    if not req.input_ids:
        raise errors.MalformedRequest("input_ids must not be empty")
    bad = next((t for t in req.input_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise errors.MalformedRequest(f"input id {bad} is outside the vocabulary [0, {vocab_size})")
    if p.max_new_tokens < 0:
        raise errors.MalformedRequest(f"max_new_tokens must be >= 0, got {p.max_new_tokens}")
    if not p.temperature >= 0.0:
        raise errors.MalformedRequest(f"temperature must be >= 0, got {p.temperature}")
    if not 0.0 < p.top_p <= 1.0:
        raise errors.MalformedRequest(f"top_p must be in (0, 1], got {p.top_p}")
    if p.top_k != -1 and p.top_k < 1:
        raise errors.MalformedRequest(f"top_k must be -1 (disabled) or >= 1, got {p.top_k}")
    if not 0 <= req.top_logprobs_num <= vocab_size:
        raise errors.MalformedRequest(
            f"top_logprobs_num must be in 0..{vocab_size}, got {req.top_logprobs_num}"
        )
    for h in req.lumen.checkpoint if req.lumen else ():
        if not valid_endpoint(h.kv_endpoint):
            raise errors.MalformedRequest(f"holder {h.worker_id!r} has a bad kv_endpoint {h.kv_endpoint!r}")
