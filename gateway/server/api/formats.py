"""Response bodies and stream chunks for each client API: OpenAI completions, OpenAI chat, SGLang native.

A format is per request. `chunks(step)` gives the SSE payloads for one step, `closing()` what follows
the last step (a usage chunk), `response(text)` the whole body of a non-streamed request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.server.api.generation import Finish, Generation, Step

Json = dict[str, Any]


class Format(Protocol):
    def chunks(self, step: Step, g: Generation) -> list[Json]: ...

    def closing(self, g: Generation) -> list[Json]: ...

    def response(self, text: str, g: Generation) -> Json: ...


def usage(g: Generation) -> Json:
    return {
        "prompt_tokens": g.prompt_tokens,
        "completion_tokens": g.completion_tokens,
        "total_tokens": g.prompt_tokens + g.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": g.cached_tokens},
    }


@dataclass(slots=True)
class _OpenAI:
    rid: str
    model: str
    created: int
    include_usage: bool = False

    def _base(self, obj: str, choices: list[Json]) -> Json:
        return {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _chunk(self, obj: str, choice: Json) -> Json:
        chunk = self._base(obj, [choice])
        if self.include_usage:
            chunk["usage"] = None  # OpenAI: every chunk carries usage: null when usage is requested
        return chunk

    def closing(self, g: Generation) -> list[Json]:
        return [self._base(self._chunk_object, []) | {"usage": usage(g)}] if self.include_usage else []

    _chunk_object = ""


def _reason(finish: Finish | None) -> str | None:
    return None if finish is None else finish.reason


@dataclass(slots=True)
class CompletionFormat(_OpenAI):
    _chunk_object = "text_completion"

    def chunks(self, step: Step, g: Generation) -> list[Json]:
        if not step.text and step.finish is None:
            return []
        choice = {"index": 0, "text": step.text, "logprobs": None, "finish_reason": _reason(step.finish)}
        return [self._chunk("text_completion", choice)]

    def response(self, text: str, g: Generation) -> Json:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": _reason(g.finish)}
        return self._base("text_completion", [choice]) | {"usage": usage(g)}


@dataclass(slots=True)
class ChatFormat(_OpenAI):
    _chunk_object = "chat.completion.chunk"
    _started: bool = False

    def _delta(self, delta: Json, finish: Finish | None = None) -> Json:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": _reason(finish)}
        return self._chunk("chat.completion.chunk", choice)

    def chunks(self, step: Step, g: Generation) -> list[Json]:
        out = []
        if not self._started:
            self._started = True
            out.append(self._delta({"role": "assistant", "content": ""}))
        if step.text:
            out.append(self._delta({"content": step.text}))
        if step.finish is not None:
            out.append(self._delta({}, step.finish))
        return out

    def response(self, text: str, g: Generation) -> Json:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": _reason(g.finish),
        }
        return self._base("chat.completion", [choice]) | {"usage": usage(g)}


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
