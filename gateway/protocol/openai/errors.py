"""OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, and the errors that carry one.

An `OpenAIError` knows its HTTP status, its type, its code and the parameter at fault; the server in
front (the gateway's error middleware, a worker's OpenAI routes) turns it into a response. Subclasses
fix status, type and code; one-off errors may set them per instance.
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
