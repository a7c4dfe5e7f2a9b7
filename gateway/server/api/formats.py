"""Response bodies and stream chunks for each client API: OpenAI completions, OpenAI chat, SGLang native.

A format is per request. `chunks(step)` gives the SSE payloads for one step, `closing()` what follows
the last step (a usage chunk), `response(text)` the whole body of a non-streamed request. The OpenAI
shapes are gateway.protocol.openai.envelopes' (a worker's OpenAI routes send the same); `OpenAIFormat`
feeds one a `Generation`'s steps. SGLang's native form is the gateway's own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from gateway.protocol.openai import envelopes
from gateway.protocol.openai.envelopes import Envelope, Json
from gateway.server.api.generation import Finish, Generation, Step


class Format(Protocol):
    def chunks(self, step: Step, g: Generation) -> list[Json]: ...

    def closing(self, g: Generation) -> list[Json]: ...

    def response(self, text: str, g: Generation) -> Json: ...


def usage(g: Generation) -> Json:
    return envelopes.usage(g.prompt_tokens, g.completion_tokens, g.cached_tokens)


def _reason(finish: Finish | None) -> str | None:
    return None if finish is None else finish.reason


class OpenAIFormat:
    """An OpenAI completion or chat envelope, fed a Generation."""

    def __init__(self, envelope: Envelope) -> None:
        self.envelope = envelope

    def chunks(self, step: Step, g: Generation) -> list[Json]:
        return self.envelope.chunks(step.text, _reason(step.finish))

    def closing(self, g: Generation) -> list[Json]:
        return [self.envelope.usage_chunk(usage(g))] if self.envelope.include_usage else []

    def response(self, text: str, g: Generation) -> Json:
        return self.envelope.response(text, _reason(g.finish), usage(g))


@dataclass(slots=True)
class NativeFormat:
    """SGLang's default stream form: every chunk carries the cumulative text and output ids."""

    rid: str
    _text: list[str] = field(default_factory=list)

    def meta(self, g: Generation, finish: Finish | None) -> Json:
        return {
            "id": self.rid,
            "prompt_tokens": g.prompt_tokens,
            "completion_tokens": g.completion_tokens,
            "cached_tokens": g.cached_tokens,
            "finish_reason": None if finish is None else native_finish(finish, g.completion_tokens),
        }

    def chunks(self, step: Step, g: Generation) -> list[Json]:
        self._text.append(step.text)
        return [
            {
                "text": "".join(self._text),
                "output_ids": list(g.output_ids),
                "meta_info": self.meta(g, step.finish),
            }
        ]

    def closing(self, g: Generation) -> list[Json]:
        return []

    def response(self, text: str, g: Generation) -> Json:
        return {"text": text, "output_ids": list(g.output_ids), "meta_info": self.meta(g, g.finish)}


def native_finish(finish: Finish, completion_tokens: int) -> Json:
    """SGLang's finish_reason object."""
    if finish.reason == "length":
        return {"type": "length", "length": completion_tokens}
    if finish.reason == "abort":
        return {"type": "abort", "message": "the generation was aborted"}
    matched: str | int | None = (
        finish.matched_text if finish.matched_text is not None else finish.matched_token
    )
    return {"type": "stop"} if matched is None else {"type": "stop", "matched": matched}
