"""Response bodies and stream chunks for each client API: OpenAI completions, OpenAI chat, SGLang native.

A format is per request. `chunks(index, step, g)` gives the SSE payloads for one step of choice
`index`, `closing(gens)` what follows the last step (a usage chunk), `response(texts, gens)` the whole
body of a non-streamed request. The OpenAI shapes are gateway.protocol.openai.envelopes' (a worker's
OpenAI routes send the same); `OpenAIFormat` feeds one the steps of a request's `Generation`s, with
log probabilities made into text with the tokenizer. SGLang's native form (one choice) is the gateway's
own.

Usage over n choices is SGLang's (srt/entrypoints/openai/usage_processor.py): the prompt is counted
once, completion tokens are summed, and `cached_tokens` is the first choice's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from gateway.protocol.generate import TokenLogprob
from gateway.protocol.openai import envelopes
from gateway.protocol.openai.envelopes import Envelope, Json, Logprob, TokenText
from gateway.server.api.generation import Finish, Generation, Step


class Format(Protocol):
    def chunks(self, index: int, step: Step, g: Generation) -> list[Json]: ...

    def closing(self, gens: Sequence[Generation]) -> list[Json]: ...

    def response(self, texts: Sequence[str], gens: Sequence[Generation]) -> Json: ...


def usage(gens: Sequence[Generation]) -> Json:
    first = gens[0]
    completion = sum(g.completion_tokens for g in gens)
    return envelopes.usage(first.prompt_tokens, completion, first.cached_tokens)


def _reason(finish: Finish | None) -> str | None:
    return None if finish is None else finish.reason


class OpenAIFormat:
    """An OpenAI completion or chat envelope, fed a request's Generations.

    `token_text` turns a token id into its text and bytes (the tokenizer's), for log probabilities.
    """

    def __init__(self, envelope: Envelope, token_text: Callable[[int], TokenText] | None = None) -> None:
        self.envelope = envelope
        self._token_text = token_text
        self._replayed_text: set[int] = set()  # choices whose replay (a resumed stream) released text

    def logprobs(self, g: Generation, lps: Sequence[TokenLogprob]) -> list[Logprob] | None:
        """The envelope's logprobs for `lps`; None when the request asked for none."""
        if g.job.logprobs is None or self._token_text is None:
            return None
        tt = self._token_text
        return [Logprob(tt(t.token_id), t.logprob, tuple((tt(i), v) for v, i in t.top)) for t in lps]

    def chunks(self, index: int, step: Step, g: Generation) -> list[Json]:
        """A replayed step (a resumed stream) only updates the envelope's state. Where its replay
        released text, the client has every replayed token's logprob (a stream's position counts a
        choice's tokens only once its logprobs are sent, resume.py `StreamIds`): those still queued
        behind the replay's held-back text are settled, not sent again. Where it released none, the
        client has none of them: they go with the next chunk that carries text."""
        lps = self.logprobs(g, step.logprobs)
        if step.replay:
            if step.text:
                self._replayed_text.add(index)
        elif index in self._replayed_text:
            self._replayed_text.discard(index)
            self.envelope.settle(index)
        return self.envelope.chunks(step.text, _reason(step.finish), index=index, logprobs=lps)

    def closing(self, gens: Sequence[Generation]) -> list[Json]:
        return [self.envelope.usage_chunk(usage(gens))] if self.envelope.include_usage else []

    def response(self, texts: Sequence[str], gens: Sequence[Generation]) -> Json:
        choices = [
            self.envelope.choice(text, _reason(g.finish), index=i, logprobs=self.logprobs(g, g.logprobs))
            for i, (text, g) in enumerate(zip(texts, gens, strict=True))
        ]
        return self.envelope.response_of(choices, usage(gens))


@dataclass(slots=True)
class NativeFormat:
    """SGLang's default stream form: every chunk carries the cumulative text and output ids (and, with
    `return_logprob`, the cumulative `output_token_logprobs` / `output_top_logprobs` rows)."""

    rid: str
    token_text: Callable[[int], TokenText] | None = None  # set: rows carry token texts
    _text: list[str] = field(default_factory=list)

    def meta(self, g: Generation, finish: Finish | None) -> Json:
        meta: Json = {
            "id": self.rid,
            "prompt_tokens": g.prompt_tokens,
            "completion_tokens": g.completion_tokens,
            "cached_tokens": g.cached_tokens,
            "finish_reason": None if finish is None else native_finish(finish, g.completion_tokens),
        }
        if g.job.logprobs is not None:
            meta |= self._logprob_meta(g.logprobs, g.job.logprobs)
        return meta

    def _logprob_meta(self, lps: Sequence[TokenLogprob], top_n: int) -> Json:
        tt = self.token_text

        def row(lp: float | None, i: int) -> list[object]:
            return [lp, i, tt(i).text if tt is not None else None]

        meta: Json = {
            "output_token_logprobs": [row(t.logprob, t.token_id) for t in lps],
            "output_token_logprobs_length": len(lps),
        }
        if top_n > 0:
            meta["output_top_logprobs"] = [[row(v, i) for v, i in t.top] for t in lps]
        return meta

    def chunks(self, index: int, step: Step, g: Generation) -> list[Json]:
        self._text.append(step.text)
        return [
            {
                "text": "".join(self._text),
                "output_ids": list(g.output_ids),
                "meta_info": self.meta(g, step.finish),
            }
        ]

    def closing(self, gens: Sequence[Generation]) -> list[Json]:
        return []

    def response(self, texts: Sequence[str], gens: Sequence[Generation]) -> Json:
        g = gens[0]
        return {"text": texts[0], "output_ids": list(g.output_ids), "meta_info": self.meta(g, g.finish)}


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
