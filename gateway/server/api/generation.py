"""One generation as the client API sees it: `TokenDelta`s in, text `Step`s out.

A `Generation` owns the generator's iterator and closes it on every way out (finish, stop string,
error, client gone, cancellation), so the work behind it is aborted as soon as nobody needs it.

Log probabilities follow the ids: a step carries those of its ids, and `logprobs` holds every output
id's, so there is one per token counted in `completion_tokens` (a stop token, and tokens after a
stop string in the same delta, included, as SGLang reports every id of `output_ids`).

`cached_tokens` is what the worker that first streamed reported for the prompt (at most the prompt's
length): a resumed stream's later attempt sends `prompt + emitted` and may find that in a cache or a
checkpoint, which says nothing about the client's prompt.

A generation resumed from a client's Last-Event-ID (`Resumed`) gets its output again from the first id
(adopted on its worker, or replayed with the same seed) and feeds the `sent` ids the client already
has through the detokenizer as a `replay` step: the formats update their state with it (cumulative
text, chat role, logprob offsets) and nothing of it is written; what follows is exactly the rest. A
choice the client saw end (`done`) is not generated again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from types import TracebackType

from gateway.protocol.generate import TokenLogprob
from gateway.server.api.detokenize import Detokenizer
from gateway.server.api.jobs import Attempt, FinishReason, GenerateJob, Generator, TokenDelta


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
    logprobs: tuple[TokenLogprob, ...] = ()  # one per id when the job asked for logprobs
    attempt: Attempt | None = None  # the worker attempt the ids came from
    replay: bool = False  # ids the client already has (a resumed stream): update state, write nothing


@dataclass(frozen=True, slots=True)
class Resumed:
    """Where a resumed choice stood when the client's stream broke (from its Last-Event-ID)."""

    sent: int  # output ids the client's text covers
    done: bool  # the client saw the choice end
    cached_tokens: int = 0  # the usage detail the first attempt reported


class Generation:
    def __init__(
        self,
        generator: Generator,
        job: GenerateJob,
        detokenizer: Detokenizer,
        resumed: Resumed | None = None,
    ) -> None:
        self.job = job
        self._detok = detokenizer
        self.output_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.cached_tokens = 0
        self._cached_known = False
        self.finish: Finish | None = None
        self._closed = False
        self._skip = 0  # ids still to replay silently (a resumed stream)
        self._pending: TokenDelta | None = None  # the new part of a delta the replay ended inside
        self._done_tokens: int | None = None  # a choice that ended before the stream broke
        if resumed is not None:
            self.cached_tokens, self._cached_known = resumed.cached_tokens, True
            self._skip = resumed.sent
            if resumed.done:
                self._done_tokens = resumed.sent
                self.finish = Finish("stop")  # ended; its reason was sent already
        self._it = generator.generate(job) if self._done_tokens is None else _nothing()

    @property
    def prompt_tokens(self) -> int:
        return len(self.job.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids) if self._done_tokens is None else self._done_tokens

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
        if self._pending is not None:
            delta, self._pending = self._pending, None
            return await self._take(delta)
        try:
            delta = await anext(self._it)
        except StopAsyncIteration:
            # the generator ended without saying why: a full budget is "length", anything else "abort"
            full = self.completion_tokens >= self.job.sampling.max_new_tokens
            return await self._end(self._detok.finish(), (), Finish("length" if full else "abort"))
        if self._skip:
            n = min(self._skip, len(delta.ids))
            self._skip -= n
            head, lps = delta.ids[:n], delta.logprobs[:n]
            self.output_ids.extend(head)
            self.logprobs.extend(lps)
            text = self._detok.feed(head)
            if n == len(delta.ids) and delta.finish_reason is None:
                return Step(text, head, None, lps, delta.attempt, replay=True)
            # the rest of this delta is new to the client: keep it for the next call
            self._pending = TokenDelta(
                delta.ids[n:], delta.finish_reason, delta.matched_stop, delta.cached_tokens,
                delta.logprobs[n:], delta.attempt,
            )  # fmt: skip
            return Step(text, head, None, lps, delta.attempt, replay=True)
        return await self._take(delta)

    async def _take(self, delta: TokenDelta) -> Step:
        self.output_ids.extend(delta.ids)
        self.logprobs.extend(delta.logprobs)
        if not self._cached_known and delta.ids:
            self._cached_known = True
            self.cached_tokens = min(delta.cached_tokens, self.prompt_tokens)
        lps = delta.logprobs
        shown = delta.ids
        matched = delta.matched_stop if delta.finish_reason == "stop" else None
        if matched is not None and shown and shown[-1] == matched:
            shown = shown[:-1]  # a matched stop token is not part of the text
        text = self._detok.feed(shown)
        at = delta.attempt
        if self._detok.matched is not None:
            return await self._end(text, delta.ids, Finish("stop", matched_text=self._detok.matched), lps, at)
        if delta.finish_reason is None:
            return Step(text, delta.ids, None, lps, at)
        text += self._detok.finish()
        if self._detok.matched is not None:  # the flushed tail completed a stop string
            return await self._end(text, delta.ids, Finish("stop", matched_text=self._detok.matched), lps, at)
        return await self._end(text, delta.ids, Finish(delta.finish_reason, matched_token=matched), lps, at)

    async def _end(
        self,
        text: str,
        ids: tuple[int, ...],
        finish: Finish,
        logprobs: tuple[TokenLogprob, ...] = (),
        attempt: Attempt | None = None,
    ) -> Step:
        self.finish = finish
        await self.close()  # a stop string ends the work early: abort it now, not when the client reads
        return Step(text, ids, finish, logprobs, attempt)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        aclose = getattr(self._it, "aclose", None)
        if aclose is not None:
            await aclose()


async def _nothing() -> AsyncIterator[TokenDelta]:
    return
    yield


class Choices:
    """The n generations of one request (`n` choices), read as one: `next()` gives `(index, step)` of
    whichever choice has a step, in the order they come, and None once every choice has ended.

    One choice is read directly; several are each read by a task of their own, so a slow or
    resuming choice never holds the others back. The first error of any choice is raised (the
    request fails as a whole); leaving (`close`, `async with`) cancels the readers and closes every
    generation, which aborts what still runs on the workers.
    """

    def __init__(self, gens: list[Generation]) -> None:
        if not gens:
            raise ValueError("a request has at least one choice")
        self.gens = gens
        self._queue: asyncio.Queue[tuple[int, Step | BaseException | None]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._open = len(gens)  # choices whose last step is not read yet

    @property
    def job(self) -> GenerateJob:
        return self.gens[0].job

    async def __aenter__(self) -> Choices:
        return self

    async def __aexit__(
        self, tp: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def next(self) -> tuple[int, Step] | None:
        if len(self.gens) == 1:
            step = await self.gens[0].next()
            return None if step is None else (0, step)
        if not self._tasks:
            loop = asyncio.get_running_loop()
            self._tasks = [
                loop.create_task(self._read(i, g), name=f"choice-{g.job.rid}")
                for i, g in enumerate(self.gens)
            ]
        while self._open:
            index, item = await self._queue.get()
            if item is None:
                self._open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                return index, item
        return None

    async def _read(self, index: int, gen: Generation) -> None:
        try:
            while (step := await gen.next()) is not None:
                self._queue.put_nowait((index, step))
        except Exception as exc:  # handed to the reader of `next`, which raises it
            self._queue.put_nowait((index, exc))
            return
        self._queue.put_nowait((index, None))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for g in self.gens:
            await g.close()
