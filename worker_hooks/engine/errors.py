"""What Lumen's worker server refuses, as OpenAI errors (gateway/protocol/openai/errors.py: the one
tree it shares with the gateway): the kinds below are the worker's own; the rest (`Unauthorized`,
`PromptTooLong`, ...) are raised from the shared tree as they are. Each becomes its HTTP status and
OpenAI error body in one place (http.py, `error_response`); a body that does not decode becomes a
`MalformedRequest` there too (`decoded`)."""

from __future__ import annotations

from gateway.protocol.openai.errors import InvalidRequest, NotFound, OpenAIError


class MalformedRequest(InvalidRequest):
    """A request the worker cannot take as sent: a body that does not decode, a field out of range."""

    code = "invalid_request"


class UnsupportedVersion(MalformedRequest):
    code = "unsupported_protocol_version"


class DuplicateRequest(MalformedRequest):
    code = "duplicate_request_id"


class NoOrphan(NotFound):
    """`/lumen/adopt` named a request this worker does not keep orphaned (finished, aborted, unknown)."""

    code = "not_found"


class StaleEpoch(OpenAIError):
    """The gateway addressed another incarnation of this worker (DESIGN 4.3 fencing)."""

    status = 409
    type = "conflict_error"
    code = "stale_epoch"


class NotServing(OpenAIError):
    """The worker is loading or draining and takes no new requests."""

    status = 503
    type = "service_unavailable"
    code = "not_serving"
