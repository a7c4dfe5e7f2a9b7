"""Who may start a client request: the API key (auth.py), then the key's own limits (ratelimit.py).

A guarded handler first checks the bearer key (401), then admits the request against its key's
concurrency and rate limits (limits.per_key_*; 429 with `Retry-After`), and holds its slot until the
handler returns, a stream's last byte included. Without API keys the key is the client's address.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from gateway.config import LimitsSection
from gateway.server.api.auth import check_bearer
from gateway.server.api.errors import RateLimited
from gateway.server.api.ratelimit import KeyLimiter, Limits

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

KEY_ID = web.RequestKey("lumen_key_id", str)  # the matched API key's key_id; absent when auth is off


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
            if limiter is None:
                return await handler(request)
            key = client_key(request)
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
