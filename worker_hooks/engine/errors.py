"""The engine's exception tree. Each maps to one HTTP status and OpenAI-style error body in server.py."""

from __future__ import annotations


class EngineError(Exception):
    status: int = 500
    type: str = "internal_error"
    code: str | None = None

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def body(self) -> dict[str, object]:
        # OpenAI's shape, as the gateway's and the worker's OpenAI routes answer (param: none named)
        return {"error": {"message": self.message, "type": self.type, "param": None, "code": self.code}}


class InvalidRequest(EngineError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class UnsupportedVersion(InvalidRequest):
    code = "unsupported_protocol_version"


class PromptTooLong(InvalidRequest):
    code = "context_length_exceeded"


class DuplicateRequest(InvalidRequest):
    code = "duplicate_request_id"


class Unauthorized(EngineError):
    """A request without the cluster's bearer (gateway/protocol/secrets.py)."""

    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class NotFound(EngineError):
    status = 404
    type = "not_found_error"
    code = "not_found"


class StaleEpoch(EngineError):
    """The gateway addressed another incarnation of this worker (DESIGN 4.3 fencing)."""

    status = 409
    type = "conflict_error"
    code = "stale_epoch"


class NotServing(EngineError):
    """The worker is loading or draining and takes no new requests."""

    status = 503
    type = "service_unavailable"
    code = "not_serving"
