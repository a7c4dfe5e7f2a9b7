"""OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, and the errors that carry one.

The one OpenAI error tree: the gateway (gateway/server/api/errors.py adds its own kinds) and Lumen's
worker server (worker_hooks/engine/errors.py adds its own) raise these classes and subclass them; no
other module declares an error of the same name (tests/unit/test_import_boundaries.py).

An `OpenAIError` knows its HTTP status, its type, its code and the parameter at fault; the server in
front (the gateway's error middleware, the worker's `error_response`) turns it into a response.
Subclasses fix status, type and code; one-off errors may set them per instance. Foreign errors
(aiohttp's, msgspec's, a worker's answer) become one of these in one place per boundary, with
`raise ... from`.
"""

from __future__ import annotations


def error_body(
    message: str, type: str, code: str | None = None, param: str | None = None
) -> dict[str, object]:
    """OpenAI's error body; `param` is always present (null when no parameter is at fault)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class OpenAIError(Exception):
    status: int = 500
    type: str = "internal_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type

    def body(self) -> dict[str, object]:
        return error_body(self.message, self.type, self.code, self.param)


class InvalidRequest(OpenAIError):
    status = 400
    type = "invalid_request_error"


class PromptTooLong(InvalidRequest):
    code = "context_length_exceeded"


class NotFound(OpenAIError):
    status = 404
    type = "not_found_error"


class ModelNotFound(NotFound):
    code = "model_not_found"


class RequestTooLarge(OpenAIError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class RequestTimeout(OpenAIError):
    """The request body did not arrive in time (the gateway's limits.body_timeout_s); the answer closes
    the connection."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class Unauthorized(OpenAIError):
    """No bearer, or not the one expected (the gateway's API keys; a worker's cluster bearer)."""

    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(OpenAIError):
    status = 403
    type = "permission_error"


class Overloaded(OpenAIError):
    """429: answered with `Retry-After` (whole seconds)."""

    status = 429
    type = "rate_limit_error"
    code = "too_many_requests"
    retry_after_s: float = 1.0
