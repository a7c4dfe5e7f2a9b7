"""Who may start a client request: the API key (auth.py), then the key's own limits (ratelimit.py),
then a fair share of the gateway's capacity for its work.

A guarded handler first checks the bearer key (401), then admits the request against its key's
concurrency and rate limits (limits.per_key_*; 429 with `Retry-After`), and holds its slot until the
handler returns, a stream's last byte included. Without API keys the key is the client's address.

Work, not requests (issue 29): every choice of a request is a job of `prompt tokens + max new tokens`
of work, admitted by `FairGenerator` through `ratelimit.FairShare` before it reaches a worker. The
gateway's capacity is `limits.work_per_worker_tokens` per healthy worker; beyond it, jobs wait per
key and the least served key goes first, so one key's large requests (n=16 over a 30k prompt) take
turns with the others' instead of filling every worker's queue ahead of them; a key with nothing in
flight starts at once. A job that waits past `limits.work_queue_timeout_s` is refused (429).
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from gateway.config import LimitsSection
from gateway.server.api.auth import check_bearer
from gateway.server.api.errors import RateLimited
from gateway.server.api.jobs import GenerateJob, Generator, TokenDelta
from gateway.server.api.ratelimit import FairShare, KeyLimiter, Limits, WorkTicket

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

KEY_ID = web.RequestKey("lumen_key_id", str)  # the matched API key's key_id; absent when auth is off
# the key the running handler's work is counted for (set by `guard`, read by FairGenerator)
CURRENT_KEY: contextvars.ContextVar[str] = contextvars.ContextVar("lumen_client_key", default="")


def limiter_of(limits: LimitsSection) -> KeyLimiter | None:
    """The per-key limiter the config asks for; None when it sets no per-key limit."""
    lim = Limits(limits.per_key_max_concurrent, limits.per_key_rate_per_s, limits.per_key_burst)
    return KeyLimiter(lim, time.monotonic) if lim.enabled else None


def client_key(request: web.Request) -> str:
    """What the per-key limits count by: the API key's key_id, else the client's address."""
    if KEY_ID in request:
        return request[KEY_ID]
    return f"addr:{request.remote or 'unknown'}"


def guard(keys: tuple[str, ...], limiter: KeyLimiter | None) -> Callable[[Handler], Handler]:
    def wrap(handler: Handler) -> Handler:
        async def guarded(request: web.Request) -> web.StreamResponse:
            found = check_bearer(request, keys)
            if found is not None:
                request[KEY_ID] = found
            key = client_key(request)
            CURRENT_KEY.set(key)  # the handler's task (and the tasks it starts) count work for it
            if limiter is None:
                return await handler(request)
            refused = limiter.admit(key)
            if refused is not None:
                lim = limiter.limits
                why = (
                    f"at most {lim.max_concurrent} concurrent requests per API key"
                    if refused.reason == "concurrency"
                    else f"at most {lim.rate_per_s:g} requests per second per API key (burst {lim.capacity:g})"
                )
                raise RateLimited(f"rate limit exceeded: {why}", retry_after_s=refused.retry_after_s)
            try:
                return await handler(request)
            finally:
                limiter.release(key)

        guarded.__doc__ = handler.__doc__
        return guarded

    return wrap


class FairGenerator:
    """A Generator that admits each job's work through a FairShare before the inner one runs it."""

    def __init__(
        self, inner: Generator, *, per_worker_tokens: int, healthy: Callable[[], int], queue_timeout_s: float
    ) -> None:
        self.inner = inner
        self.share = FairShare(lambda: per_worker_tokens * max(1, healthy()))
        self.queue_timeout_s = queue_timeout_s
        self._wakers: dict[int, asyncio.Event] = {}

    def __getattr__(self, name: str) -> object:  # everything else is the inner generator's
        return getattr(self.inner, name)

    async def generate(self, job: GenerateJob) -> AsyncIterator[TokenDelta]:
        ticket = self.share.request(
            CURRENT_KEY.get() or "anonymous", len(job.prompt_ids) + job.sampling.max_new_tokens
        )
        try:
            if not ticket.admitted:
                await self._wait(ticket)
            first = True
            async for delta in self.inner.generate(job):
                # work done: the prompt once the first token is out, then each token
                self._wake(self.share.done(ticket, len(delta.ids) + (len(job.prompt_ids) if first else 0)))
                first = False
                yield delta
        finally:
            self._wake(self.share.release(ticket))

    async def _wait(self, ticket: WorkTicket) -> None:
        event = self._wakers[id(ticket)] = asyncio.Event()
        try:
            async with asyncio.timeout(self.queue_timeout_s):
                await event.wait()
        except TimeoutError:
            raise RateLimited(
                f"this API key's share of the gateway stayed in use by its other requests for "
                f"{self.queue_timeout_s:g} s (limits.work_queue_timeout_s)",
                retry_after_s=1.0,
            ) from None
        finally:
            self._wakers.pop(id(ticket), None)

    def _wake(self, admitted: list[WorkTicket]) -> None:
        for ticket in admitted:
            event = self._wakers.get(id(ticket))
            if event is not None:
                event.set()


def fair_generator(inner: Generator, limits: LimitsSection) -> Generator:
    """`inner` behind fair work shares (FairGenerator); `inner` itself when limits.work_per_worker_tokens
    is 0 (off). The healthy worker count comes from the inner generator's monitor when it has one."""
    if limits.work_per_worker_tokens <= 0:
        return inner
    monitor = getattr(inner, "monitor", None)
    healthy: Callable[[], int] = monitor.healthy_count if monitor is not None else (lambda: 1)
    return FairGenerator(
        inner,
        per_worker_tokens=limits.work_per_worker_tokens,
        healthy=healthy,
        queue_timeout_s=limits.work_queue_timeout_s,
    )
