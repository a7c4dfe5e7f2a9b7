"""One generation as the client API sees it: `TokenDelta`s in, text `Step`s out.

A `Generation` owns the generator's iterator and closes it on every way out (finish, stop string,
error, client gone, cancellation), so the work behind it is aborted as soon as nobody needs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import TracebackType

from gateway.server.api.detokenize import Detokenizer
from gateway.server.api.jobs import FinishReason, GenerateJob, Generator


@dataclass(frozen=True, slots=True)
class Finish:
    reason: FinishReason
    matched_token: int | None = None  # the stop token id, when a stop token ended the generation
    matched_text: str | None = None  # the stop string, when a stop string did


@dataclass(frozen=True, slots=True)
class Step:
    text: str  # new text safe to show ("" while characters or stop-string prefixes are pending)
    ids: tuple[int, ...]  # new output ids
    finish: Finish | None = None  # set on the last step only


class Generation:
    def __init__(self, generator: Generator, job: GenerateJob, detokenizer: Detokenizer) -> None:
        self.job = job
        self._it = generator.generate(job)
        self._detok = detokenizer
        self.output_ids: list[int] = []
        self.cached_tokens = 0
        self.finish: Finish | None = None
        self._closed = False

    @property
    def prompt_tokens(self) -> int:
        return len(self.job.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(
        self, tp: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def next(self) -> Step | None:
        """The next step, or None after the last. Raises what the generator raises (GatewayError)."""
        if self.finish is not None:
            return None
        try:
            delta = await anext(self._it)
        except StopAsyncIteration:
            # the generator ended without saying why: a full budget is "length", anything else "abort"
            full = self.completion_tokens >= self.job.sampling.max_new_tokens
            return await self._end(self._detok.finish(), (), Finish("length" if full else "abort"))
        self.output_ids.extend(delta.ids)
        self.cached_tokens = max(self.cached_tokens, delta.cached_tokens)
        shown = delta.ids
        matched = delta.matched_stop if delta.finish_reason == "stop" else None
        if matched is not None and shown and shown[-1] == matched:
            shown = shown[:-1]  # a matched stop token is not part of the text
        text = self._detok.feed(shown)
        if self._detok.matched is not None:
            return await self._end(text, delta.ids, Finish("stop", matched_text=self._detok.matched))
        if delta.finish_reason is None:
            return Step(text, delta.ids)
        text += self._detok.finish()
        if self._detok.matched is not None:  # the flushed tail completed a stop string
            return await self._end(text, delta.ids, Finish("stop", matched_text=self._detok.matched))
        return await self._end(text, delta.ids, Finish(delta.finish_reason, matched_token=matched))

    async def _end(self, text: str, ids: tuple[int, ...], finish: Finish) -> Step:
        self.finish = finish
        await self.close()  # a stop string ends the work early: abort it now, not when the client reads
        return Step(text, ids, finish)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        aclose = getattr(self._it, "aclose", None)
        if aclose is not None:
            await aclose()
