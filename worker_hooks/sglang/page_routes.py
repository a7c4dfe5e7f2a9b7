"""Which holders each page SGLang writes goes to: SGLang's storage calls carry neither a request id nor
token ids, so a table maps page keys to the requests (and their holders) that own them. Filled by
whoever knows a request's tokens and its holders (the gateway's kv_hints); read by the page store."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from gateway.protocol.kv import DEFAULT_PAGE_SIZE
from gateway.protocol.pagekeys import page_keys


# -- routing --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class PageRoute:
    """Where one page goes: request `rid`'s page number `page_index`, to `holders` (base endpoints)."""

    rid: str
    holders: tuple[str, ...]
    page_index: int
    token_ids: tuple[int, ...]  # the page's ids (len = page size)
    parent_key: str | None  # key of page page_index - 1, or the chain's prior (namespace seed) for page 0


RouteLookup = Callable[[str], Sequence[PageRoute]]


@dataclass(slots=True, eq=False)
class _Routed:
    tokens: list[int]
    holders: tuple[str, ...]
    prior: str | None
    keys: list[str] = field(default_factory=list)


class RequestRoutes:
    """Page key -> the live requests (and their holders) whose sequence holds that page. Thread-safe.

    Memory: the token ids and page keys of every admitted request until `retire`; the filler retires a
    request when it ends (or the gateway drops its checkpoint).
    """

    def __init__(self, page_size: int = DEFAULT_PAGE_SIZE) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self._lock = threading.Lock()
        self._reqs: dict[str, _Routed] = {}
        self._by_key: dict[str, dict[str, int]] = {}  # key -> {rid: page index}

    def admit(
        self, rid: str, token_ids: Sequence[int], holders: Iterable[str], *, prior: str | None = None
    ) -> list[str]:
        """Route request `rid` (its whole sequence so far) to `holders`; returns its page keys.
        `prior` is the chain's seed (`pagekeys.namespace_seed` of its extra_key / cache_salt)."""
        with self._lock:
            self._retire(rid)
            req = self._reqs[rid] = _Routed([], tuple(dict.fromkeys(holders)), prior)
            return self._extend(rid, req, token_ids)

    def extend(self, rid: str, token_ids: Sequence[int]) -> list[str]:
        """Tokens appended to `rid`'s sequence; returns the keys of the pages they completed."""
        with self._lock:
            req = self._reqs.get(rid)
            return [] if req is None else self._extend(rid, req, token_ids)

    def set_holders(self, rid: str, holders: Iterable[str]) -> None:
        with self._lock:
            req = self._reqs.get(rid)
            if req is not None:
                req.holders = tuple(dict.fromkeys(holders))

    def retire(self, rid: str) -> None:
        with self._lock:
            self._retire(rid)

    def rids(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._reqs)

    def __call__(self, key: str) -> list[PageRoute]:
        ps = self.page_size
        with self._lock:
            out = []
            for rid, idx in self._by_key.get(key, {}).items():
                req = self._reqs[rid]
                parent = req.keys[idx - 1] if idx else req.prior
                ids = tuple(req.tokens[idx * ps : (idx + 1) * ps])
                out.append(PageRoute(rid, req.holders, idx, ids, parent))
            return out

    def _extend(self, rid: str, req: _Routed, token_ids: Sequence[int]) -> list[str]:
        ps = self.page_size
        req.tokens.extend(int(t) for t in token_ids)
        done = len(req.keys)
        full = len(req.tokens) // ps
        if full <= done:
            return []
        prior = req.keys[-1] if req.keys else req.prior
        new = page_keys(req.tokens[done * ps : full * ps], ps, prior)
        for i, key in enumerate(new):
            self._by_key.setdefault(key, {})[rid] = done + i
        req.keys.extend(new)
        return new

    def _retire(self, rid: str) -> None:
        req = self._reqs.pop(rid, None)
        if req is None:
            return
        for key in req.keys:
            rids = self._by_key.get(key)
            if rids is not None:
                rids.pop(rid, None)
                if not rids:
                    del self._by_key[key]


def no_routes(key: str) -> Sequence[PageRoute]:
    """A lookup that routes nothing: a page store that only serves reads."""
    return ()
