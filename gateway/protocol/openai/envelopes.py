"""OpenAI response bodies and stream chunks: completions and chat completions, and their SSE framing.

An envelope is per request and built from plain values (text, finish reason, token counts), so the
gateway (from its `Generation`) and a worker (from its engine's emissions) send the same bytes.
`chunks(text, finish)` gives the chunks of one step, `usage_chunk` the last chunk of a stream that
asked for usage (`stream_options.include_usage`; then every other chunk has `usage: null`), and
`response` the whole body of a request that is not streamed. A stream ends with `data: [DONE]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from gateway.protocol.generate import SSE_DONE

Json = dict[str, Any]

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
__all__ = [
    "SSE_DONE",
    "SSE_HEADERS",
    "ChatEnvelope",
    "CompletionEnvelope",
    "Envelope",
    "Json",
    "sse_event",
    "usage",
]

_encoder = msgspec.json.Encoder()


def sse_event(obj: object) -> bytes:
    """One SSE `data:` event holding `obj` as JSON."""
    return b"data: " + _encoder.encode(obj) + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Json:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass(slots=True)
class Envelope:
    rid: str
    model: str
    created: int  # unix seconds
    include_usage: bool = False

    response_object = ""  # of a whole response
    chunk_object = ""  # of a stream chunk

    def base(self, obj: str, choices: list[Json]) -> Json:
        return {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(self, choice: Json) -> Json:
        chunk = self.base(self.chunk_object, [choice])
        if self.include_usage:
            chunk["usage"] = None  # OpenAI: every chunk carries usage: null when usage is requested
        return chunk

    def usage_chunk(self, usage: Json) -> Json:
        return self.base(self.chunk_object, []) | {"usage": usage}

    def chunks(self, text: str, finish: str | None) -> list[Json]:
        raise NotImplementedError

    def response(self, text: str, finish: str | None, usage: Json) -> Json:
        raise NotImplementedError


@dataclass(slots=True)
class CompletionEnvelope(Envelope):
    response_object = "text_completion"
    chunk_object = "text_completion"

    def chunks(self, text: str, finish: str | None) -> list[Json]:
        if not text and finish is None:
            return []
        return [self.chunk({"index": 0, "text": text, "logprobs": None, "finish_reason": finish})]

    def response(self, text: str, finish: str | None, usage: Json) -> Json:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return self.base(self.response_object, [choice]) | {"usage": usage}


@dataclass(slots=True)
class ChatEnvelope(Envelope):
    """A chat stream opens with the assistant's role, then one content delta per step with text,
    then an empty delta carrying the finish reason."""

    response_object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    _started: bool = False

    def _delta(self, delta: Json, finish: str | None = None) -> Json:
        return self.chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish})

    def chunks(self, text: str, finish: str | None) -> list[Json]:
        out = []
        if not self._started:
            self._started = True
            out.append(self._delta({"role": "assistant", "content": ""}))
        if text:
            out.append(self._delta({"content": text}))
        if finish is not None:
            out.append(self._delta({}, finish))
        return out

    def response(self, text: str, finish: str | None, usage: Json) -> Json:
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        return self.base(self.response_object, [choice]) | {"usage": usage}
