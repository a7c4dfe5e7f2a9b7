"""The gateway's exception tree. Each maps to one HTTP status and OpenAI-style error body in one place
(the error middleware in api.py); foreign errors are translated at the boundary with `raise ... from`.
"""

from __future__ import annotations


class GatewayError(Exception):
    status: int = 500
    type: str = "internal_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def body(self) -> dict[str, object]:
        err: dict[str, object] = {"message": self.message, "type": self.type, "code": self.code}
        if self.param is not None:
            err["param"] = self.param
        return {"error": err}


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"


class PromptTooLong(InvalidRequest):
    code = "context_length_exceeded"


class RequestTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class Unauthorized(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(GatewayError):
    status = 403
    type = "permission_error"


class NotFound(GatewayError):
    status = 404
    type = "not_found_error"


class ModelNotFound(NotFound):
    code = "model_not_found"


class Overloaded(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "too_many_requests"


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


class UpstreamRejected(GatewayError):
    """A worker refused the request with a 4xx that is not the gateway's fault to retry."""

    status = 502
    type = "upstream_error"
    code = "worker_rejected"
