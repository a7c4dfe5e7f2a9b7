"""OpenAI response bodies and stream chunks: completions and chat completions, and their SSE framing.

An envelope is per request and built from plain values (text, finish reason, token counts), so the
gateway (from its `Generation`s) and a worker (from its engine's emissions) send the same bytes.
`chunks(text, finish, index=i)` gives the chunks of one step of choice i, `usage_chunk` the last chunk
of a stream that asked for usage (`stream_options.include_usage`; then every other chunk has
`usage: null`), and `response` / `response_of` the whole body of a request that is not streamed. A
stream ends with `data: [DONE]`.

Log probabilities come in as `Logprob`s (a token's text and bytes, its logprob, its top tokens) and
go out in OpenAI's shapes, as SGLang's OpenAI layer builds them from the same engine rows
(srt/entrypoints/openai/utils.py `to_openai_style_logprobs`, serving_chat.py
`_build_token_logprobs_from_raw`):

- completions: `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`, a
  token's string lossless (a fragment of a multi-byte character as latin-1, one character per byte,
  `_lossless_token_text`); `text_offset` counts characters of those strings from the choice's start
  (SGLang sends -1s there);
- chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.

A logprob the worker could not represent (-inf) is sent as -9999.0, as OpenAI does. While streaming,
the logprobs of tokens whose text is still held back (a possible stop string, an incomplete character)
wait for the next chunk that carries text or the finish reason, so no chunk carries logprobs alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
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
    "Logprob",
    "TokenText",
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


@dataclass(frozen=True, slots=True)
class TokenText:
    """One token as text: what decoding it alone shows (U+FFFD for part of a character) and its bytes."""

    text: str
    raw: bytes

    @property
    def lossless(self) -> str:
        """The completions API's token string: the text, unless it is a fragment of a multi-byte
        character, then its bytes as latin-1 (SGLang's `_lossless_token_text`)."""
        if "\ufffd" not in self.text or not self.raw:
            return self.text
        try:
            self.raw.decode("utf-8")
        except UnicodeDecodeError:
            return self.raw.decode("latin-1")
        return self.text


@dataclass(frozen=True, slots=True)
class Logprob:
    """One output token's log probability and the most likely tokens at its position."""

    token: TokenText
    logprob: float | None  # None: the worker reported -inf
    top: tuple[tuple[TokenText, float | None], ...] = ()


NEG_INF_LOGPROB = -9999.0


def _num(logprob: float | None) -> float:
    return NEG_INF_LOGPROB if logprob is None else logprob


@dataclass(slots=True)
class Envelope:
    rid: str
    model: str
    created: int  # unix seconds
    include_usage: bool = False
    # per choice: logprobs of tokens whose text is not sent yet
    _pending: dict[int, list[Logprob]] = field(default_factory=dict)

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

    def chunks(
        self, text: str, finish: str | None, *, index: int = 0, logprobs: Sequence[Logprob] | None = None
    ) -> list[Json]:
        """The chunks of one step of choice `index`. `logprobs`: None when the request asked for none,
        else those of the step's tokens (sent with the first chunk that carries text or the finish)."""
        raise NotImplementedError

    def choice(
        self, text: str, finish: str | None, *, index: int = 0, logprobs: Sequence[Logprob] | None = None
    ) -> Json:
        """One choice of a whole response; `logprobs` those of all its tokens (None: not asked for)."""
        raise NotImplementedError

    def response_of(self, choices: list[Json], usage: Json) -> Json:
        return self.base(self.response_object, choices) | {"usage": usage}

    def response(
        self, text: str, finish: str | None, usage: Json, *, logprobs: Sequence[Logprob] | None = None
    ) -> Json:
        """The whole body of a one-choice response."""
        return self.response_of([self.choice(text, finish, logprobs=logprobs)], usage)

    def settle(self, index: int) -> None:
        """The client already has the logprobs queued for choice `index` (those of a resumed stream's
        replayed tokens): drop them as if sent."""
        self._pending.pop(index, None)

    def _take(self, index: int, logprobs: Sequence[Logprob] | None, send: bool) -> list[Logprob] | None:
        """Queue `logprobs` for choice `index`; everything queued when `send`, else None."""
        if logprobs is None:
            return None
        pending = self._pending.setdefault(index, [])
        pending.extend(logprobs)
        if not send:
            return None
        self._pending[index] = []
        return pending


@dataclass(slots=True)
class CompletionEnvelope(Envelope):
    response_object = "text_completion"
    chunk_object = "text_completion"
    _offsets: dict[int, int] = field(default_factory=dict)  # per choice: characters of tokens sent

    def chunks(
        self, text: str, finish: str | None, *, index: int = 0, logprobs: Sequence[Logprob] | None = None
    ) -> list[Json]:
        send = bool(text) or finish is not None
        lps = self._take(index, logprobs, send)
        if not send:
            return []
        rendered = None
        if lps is not None:
            rendered, self._offsets[index] = completion_logprobs(lps, self._offsets.get(index, 0))
        return [self.chunk({"index": index, "text": text, "logprobs": rendered, "finish_reason": finish})]

    def settle(self, index: int) -> None:
        pending = self._pending.pop(index, None)
        if pending:  # their characters count in the text offsets that follow
            self._offsets[index] = completion_logprobs(pending, self._offsets.get(index, 0))[1]

    def choice(
        self, text: str, finish: str | None, *, index: int = 0, logprobs: Sequence[Logprob] | None = None
    ) -> Json:
        rendered = None if logprobs is None else completion_logprobs(logprobs, 0)[0]
        return {"index": index, "text": text, "logprobs": rendered, "finish_reason": finish}


def completion_logprobs(logprobs: Sequence[Logprob], offset: int) -> tuple[Json, int]:
    """A completion choice's `logprobs` object, its text offsets from `offset`; and the next offset."""
    tokens: list[str] = []
    values: list[float] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    for lp in logprobs:
        s = lp.token.lossless
        tokens.append(s)
        values.append(_num(lp.logprob))
        offsets.append(offset)
        offset += len(s)
        top: dict[str, float] = {}
        for t, v in lp.top:
            top.setdefault(t.lossless, _num(v))  # two ids with one string: the likelier one stays
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, offset


def chat_logprobs(logprobs: Sequence[Logprob]) -> Json:
    """A chat choice's `logprobs` object."""
    return {
        "content": [
            {
                "token": lp.token.text,
                "logprob": _num(lp.logprob),
                "bytes": list(lp.token.raw),
                "top_logprobs": [
                    {"token": t.text, "logprob": _num(v), "bytes": list(t.raw)} for t, v in lp.top
                ],
            }
            for lp in logprobs
        ]
    }


@dataclass(slots=True)
class ChatEnvelope(Envelope):
    """A chat stream opens each choice with the assistant's role, then one content delta per step with
    text, then an empty delta carrying the finish reason."""

    response_object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    _started: set[int] = field(default_factory=set)

    def _delta(
        self, index: int, delta: Json, finish: str | None = None, logprobs: Json | None = None
    ) -> Json:
        return self.chunk({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})

    def chunks(
        self, text: str, finish: str | None, *, index: int = 0, logprobs: Sequence[Logprob] | None = None
    ) -> list[Json]:
        out = []
        if index not in self._started:
            self._started.add(index)
            out.append(self._delta(index, {"role": "assistant", "content": ""}))
        lps = self._take(index, logprobs, bool(text) or finish is not None)
        rendered = None if lps is None else chat_logprobs(lps)
        if text:
            out.append(self._delta(index, {"content": text}, logprobs=rendered))
            rendered = None
        if finish is not None:
            out.append(self._delta(index, {}, finish, rendered))
        return out

    def choice(
        self, text: str, finish: str | None, *, index: int = 0, logprobs: Sequence[Logprob] | None = None
    ) -> Json:
        message = {"role": "assistant", "content": text}
        rendered = None if logprobs is None else chat_logprobs(logprobs)
        return {"index": index, "message": message, "logprobs": rendered, "finish_reason": finish}
