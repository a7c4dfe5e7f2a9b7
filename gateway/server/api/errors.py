"""The gateway's exception tree: OpenAI's (gateway/protocol/openai/errors.py, shared with Lumen's
worker server; re-exported here, `GatewayError` is `OpenAIError`) and the gateway's own kinds below.
Each maps to one HTTP status and OpenAI-style error body in one place (the error middleware,
middleware.py); foreign errors are translated at the boundary with `raise ... from`.
"""

from __future__ import annotations

from gateway.protocol.openai.errors import (
    Forbidden,
    InvalidRequest,
    ModelNotFound,
    NotFound,
    OpenAIError,
    Overloaded,
    PromptTooLong,
    RequestTimeout,
    RequestTooLarge,
    Unauthorized,
)

__all__ = [
    "Forbidden",
    "GatewayError",
    "InvalidRequest",
    "ModelNotFound",
    "NoWorkerAvailable",
    "NotFound",
    "Overloaded",
    "PromptTooLong",
    "RateLimited",
    "RequestTimeout",
    "RequestTooLarge",
    "Unauthorized",
    "UnreadableBody",
    "UpstreamFailed",
    "UpstreamRejected",
]

GatewayError = OpenAIError


class UnreadableBody(InvalidRequest):
    """A body the server cannot decode (a broken compressed stream): after it the connection's input
    is in an unknown state, so the answer closes the connection."""

    code = "invalid_encoding"


class RateLimited(Overloaded):
    """An API key over its per-key concurrency or rate limit (limits.per_key_*)."""

    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NoWorkerAvailable(GatewayError):
    """No HEALTHY worker appeared within `recovery.no_worker_wait_s`."""

    status = 503
    type = "service_unavailable"
    code = "no_healthy_worker"


class UpstreamFailed(GatewayError):
    """The serving worker failed and the request could not (or, in mode `none`, may not) resume."""

    status = 502
    type = "upstream_error"
    code = "worker_failed"


class UpstreamRejected(InvalidRequest):
    """A worker refused the request's content (400, 413 or 422: `WorkerRefused.request_fault`, e.g. a
    prompt past the server's context length): the client's 4xx, with the worker's message (status 413
    for 413, else 400). A refusal that is the worker's own (401, 403, 404, 408, 429, ...) is retried on
    another worker instead, and a verification call refused for its drafts decodes plainly (sessions.py,
    recovery/assisted.py); neither reaches the client."""

    code = "worker_rejected"
