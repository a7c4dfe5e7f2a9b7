"""Bearer API keys for the client API and the admin API (separate key sets).

The admin API always needs its key (there is no open or loopback-only mode: any local user can reach
loopback); a gateway configured with none generates one (gateway/server/control_secret.py).

Keys are compared in constant time over SHA-256 digests, so neither a key's content nor its length
leaks through timing, and every configured key is compared on every request. A matched key is known
downstream (logs, metrics labels) only by `key_id`, never by its value.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from aiohttp import hdrs, web

from gateway.config.sections import GatewaySection
from gateway.server.api.errors import Unauthorized


def key_id(key: str) -> str:
    """A stable, non-secret name for a key: 'key-' + the first 8 hex digits of its SHA-256."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:8]


def bearer_token(request: web.Request) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, or None."""
    header = request.headers.get(hdrs.AUTHORIZATION, "")
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def match_key(token: str, keys: Sequence[str]) -> str | None:
    """The key_id of the key equal to `token`, or None. Constant time in the token's content."""
    digest = hashlib.sha256(token.encode()).digest()
    found: str | None = None
    for key in keys:  # no early exit: the time does not tell which key (if any) matched
        if hmac.compare_digest(digest, hashlib.sha256(key.encode()).digest()) and found is None:
            found = key_id(key)
    return found


def check_bearer(request: web.Request, keys: Sequence[str]) -> str | None:
    """Authenticate against `keys`: the matched key_id; None when no keys are configured (open).

    Raises Unauthorized (401) when keys are configured and the request has none or a wrong one.
    """
    if not keys:
        return None
    token = bearer_token(request)
    if token is None:
        raise Unauthorized("missing API key: send the header 'Authorization: Bearer <key>'")
    found = match_key(token, keys)
    if found is None:
        raise Unauthorized("invalid API key")
    return found


def require_admin(request: web.Request, admin_keys: Sequence[str]) -> str:
    """Admin access: a valid admin key, from any address, loopback included (another local user is
    not the operator). The gateway always has one (a generated key when none is configured,
    gateway/server/control_secret.py); with none at all, every admin request is refused.

    Returns the matched key_id; raises Unauthorized (401).
    """
    if not admin_keys:
        raise Unauthorized("the admin API has no key configured")
    found = check_bearer(request, admin_keys)
    assert found is not None  # keys are configured: check_bearer matched one or raised
    return found


def require_metrics(request: web.Request, g: GatewaySection) -> None:
    """/metrics: open when `gateway.metrics_public` (the default); else a client API key or an admin
    key (401 otherwise; with neither kind configured, the generated admin key)."""
    if g.metrics_public:
        return
    token = bearer_token(request)
    if token is None:
        raise Unauthorized(
            "/metrics needs a key (gateway.metrics_public = false): 'Authorization: Bearer <key>'"
        )
    if match_key(token, g.api_keys) is None and match_key(token, g.admin_api_keys) is None:
        raise Unauthorized("invalid key for /metrics")
