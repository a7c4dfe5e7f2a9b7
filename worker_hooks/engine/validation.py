"""Admission checks on a /generate request: what the engine refuses before anything changes."""

from __future__ import annotations

from gateway.protocol.generate import GenerateRequest
from worker_hooks.engine import errors
from worker_hooks.engine.checkpointing import valid_endpoint


def validate(req: GenerateRequest, vocab_size: int) -> None:
    """Raise InvalidRequest naming the first field that is out of range."""
    p = req.sampling_params
    if not req.rid:
        raise errors.InvalidRequest("rid must be a non-empty string")
    if not req.input_ids:
        raise errors.InvalidRequest("input_ids must not be empty")
    bad = next((t for t in req.input_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise errors.InvalidRequest(f"input id {bad} is outside the vocabulary [0, {vocab_size})")
    if p.max_new_tokens < 0:
        raise errors.InvalidRequest(f"max_new_tokens must be >= 0, got {p.max_new_tokens}")
    if not p.temperature >= 0.0:
        raise errors.InvalidRequest(f"temperature must be >= 0, got {p.temperature}")
    if not 0.0 < p.top_p <= 1.0:
        raise errors.InvalidRequest(f"top_p must be in (0, 1], got {p.top_p}")
    if p.top_k != -1 and p.top_k < 1:
        raise errors.InvalidRequest(f"top_k must be -1 (disabled) or >= 1, got {p.top_k}")
    if not 0 <= req.top_logprobs_num <= vocab_size:
        raise errors.InvalidRequest(
            f"top_logprobs_num must be in 0..{vocab_size}, got {req.top_logprobs_num}"
        )
    for h in req.lumen.checkpoint if req.lumen else ():
        if not valid_endpoint(h.kv_endpoint):
            raise errors.InvalidRequest(f"holder {h.worker_id!r} has a bad kv_endpoint {h.kv_endpoint!r}")
