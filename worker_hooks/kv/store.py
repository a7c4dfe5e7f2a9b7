"""The holder's checkpoint store (DESIGN 4.4): content-addressed KV pages within a byte budget.

Pure: no sockets, no logging; time comes from the injected clock. Pages are keyed by their HiCache
page key (`gateway.protocol.pagekeys`) and refcounted by the request chains that reference them, so a
prefix shared by many requests is stored once. A chain is one request's pages 0..n-1 in order, owned
by one (src_worker, incarnation); only full pages are ever held.

Invariants (checked by `check_integrity`): bytes_used == Σ page sizes ≤ budget_bytes; a page's
refcount == the number of chains listing it; every chain is contiguous (page i's parent is page i-1's
key, page 0's parent is the chain's prior), hence refs(parent) ≥ refs(child) and a held page always
has its whole prefix held.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.protocol.pagekeys import as_token_array, is_key, page_keys
from worker_hooks.kv.eviction import Eviction, eviction_order
from worker_hooks.kv.pagetable import IntegrityError, PageTable
from worker_hooks.kv.types import ChainInfo, HoldResult, StoreStats

__all__ = ["ChainInfo", "CheckpointStore", "Eviction", "HoldResult", "IntegrityError", "StoreStats"]

Buffer = bytes | bytearray | memoryview


@dataclass(slots=True, eq=False)
class _Chain:
    rid: str
    src_worker: str
    incarnation: int
    page_size: int
    prior: str | None
    seq: int
    keys: list[str] = field(default_factory=list)
    touched: float = 0.0
    truncated: bool = False

    @property
    def durable_tokens(self) -> int:
        return len(self.keys) * self.page_size


def _flat(data: Buffer) -> memoryview:
    mv = memoryview(data)
    return mv if mv.ndim == 1 and mv.format == "B" else mv.cast("B")


class CheckpointStore:
    def __init__(
        self,
        budget_bytes: int,
        eviction: Eviction | str = Eviction.SHORTEST_PREFIX_FIRST,
        orphan_ttl_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        if orphan_ttl_s <= 0:
            raise ValueError(f"orphan_ttl_s must be > 0, got {orphan_ttl_s}")
        self.budget_bytes = budget_bytes
        self.eviction = Eviction(eviction)
        self.orphan_ttl_s = orphan_ttl_s
        self._clock = clock
        self._pages = PageTable()
        self._chains: dict[str, _Chain] = {}
        self._fence: dict[str, int] = {}  # src_worker -> newest incarnation seen
        self._seq = itertools.count()
        self._dirty: set[str] = set()
        self._reported: dict[str, int] = {}
        self._tokens_held = 0
        self._evicted_pages = self._evicted_requests = self._refused = 0
        self._deduped = self._stale = self._expired = 0

    # -- predicates -------------------------------------------------------------------------------
    def can_hold(self, n_bytes: int, rid: str | None = None) -> bool:
        """Whether `n_bytes` of new pages for `rid` fit, evicting other requests if the policy may."""
        if self.bytes_used + n_bytes <= self.budget_bytes:
            return True
        if self.eviction is Eviction.NONE:
            return False
        return self._pinned_bytes(self._chains.get(rid) if rid else None) + n_bytes <= self.budget_bytes

    def _pinned_bytes(self, chain: _Chain | None) -> int:
        # evicting every other request frees every page except the writer's own
        return sum(self._pages.nbytes(k) for k in chain.keys) if chain else 0

    # -- actions ----------------------------------------------------------------------------------
    def hold(
        self,
        rid: str,
        *,
        src_worker: str,
        incarnation: int,
        first_page: int,
        page_size: int,
        token_ids: Sequence[int],
        pages: Sequence[Buffer],
        parent_key: str | None = None,
    ) -> HoldResult:
        """Append pages first_page.. of `rid`; `parent_key` as in `gateway.protocol.kv.KvHeader`."""
        # bad input raises before anything changes
        if page_size < 1 or len(token_ids) != len(pages) * page_size:
            raise ValueError(f"{len(token_ids)} token ids for {len(pages)} pages of {page_size}")
        if parent_key is not None and not is_key(parent_key):
            raise ValueError(f"parent_key is not a page key: {parent_key[:80]!r}")
        ids = as_token_array(token_ids)
        if incarnation < self._fence.get(src_worker, -1):
            self._stale += 1
            return HoldResult(0, 0, 0, stale=True)
        self._fence[src_worker] = incarnation
        chain = self._chains.get(rid)
        if chain is None or (chain.src_worker, chain.incarnation) != (src_worker, incarnation):
            new = self._start_chain(rid, src_worker, incarnation, page_size, first_page, parent_key)
            if chain is not None and (new is not None or chain.src_worker == src_worker):
                # a newer owner replaces older data; a late gap from another worker does not
                self._release_chain(chain)
            if new is None:
                return HoldResult(0, 0, 0, gap=True)
            chain = self._chains[rid] = new
        elif first_page > len(chain.keys) or page_size != chain.page_size:
            chain.truncated = True
            return HoldResult(0, 0, 0, gap=True)
        expected = chain.keys[first_page - 1] if first_page else chain.prior
        if parent_key is not None and parent_key != expected:
            chain.truncated = True
            return HoldResult(0, 0, 0, gap=True)
        chain.touched = self._clock()
        self._dirty.add(rid)
        return self._append(chain, first_page, page_keys(ids, page_size, expected), pages)

    def _start_chain(
        self, rid: str, src_worker: str, incarnation: int, page_size: int, first_page: int, parent: str | None
    ) -> _Chain | None:
        keys: list[str] = []
        prior = parent
        if first_page:
            # continuing mid-request (e.g. after a restore): adopt the held prefix ending at parent
            found = self._pages.ancestry(parent, first_page) if parent is not None else None
            if found is None:
                return None
            keys, prior = found
            for k in keys:
                self._pages.incref(k)
        chain = _Chain(rid, src_worker, incarnation, page_size, prior, next(self._seq), keys)
        self._tokens_held += len(keys) * page_size
        return chain

    def _append(self, chain: _Chain, first_page: int, keys: list[str], pages: Sequence[Buffer]) -> HoldResult:
        accepted = deduped = 0
        evicted: list[str] = []
        for i, (key, data) in enumerate(zip(keys, pages, strict=True)):
            pos = first_page + i
            if pos < len(chain.keys):
                if chain.keys[pos] == key:
                    continue  # a resend of what is held
                self._drop_tail(chain, pos)  # newer data for this position replaces the old tail
            if key in self._pages:
                self._pages.incref(key)
                deduped += 1
            else:
                mv = _flat(data)
                if not self._make_room(mv.nbytes, chain, evicted):
                    chain.truncated = True
                    refused = len(keys) - i
                    self._refused += refused
                    self._deduped += deduped
                    return HoldResult(accepted, deduped, refused, evicted=tuple(evicted))
                self._pages.add(key, mv, chain.keys[-1] if chain.keys else chain.prior)
            chain.keys.append(key)
            self._tokens_held += chain.page_size
            accepted += 1
        self._deduped += deduped
        return HoldResult(accepted, deduped, 0, evicted=tuple(evicted))

    def _make_room(self, n_bytes: int, writer: _Chain, evicted: list[str]) -> bool:
        if self.bytes_used + n_bytes <= self.budget_bytes:
            return True
        if self.eviction is Eviction.NONE or self._pinned_bytes(writer) + n_bytes > self.budget_bytes:
            return False  # refuse rather than destroy other checkpoints in vain
        mine = set(writer.keys)
        # the request being written is never a victim
        for victim in eviction_order(self.eviction, (c for c in self._chains.values() if c is not writer)):
            if self.bytes_used + n_bytes <= self.budget_bytes:
                break
            if mine.issuperset(victim.keys):
                continue  # a prefix of the writer: dropping it frees nothing
            self._evicted_pages += self._release_chain(victim)
            self._evicted_requests += 1
            evicted.append(victim.rid)
        return self.bytes_used + n_bytes <= self.budget_bytes

    def release(self, rid: str, *, src_worker: str | None = None, incarnation: int | None = None) -> int:
        """Free a request's checkpoint (END or DROP); returns pages freed. A release naming another
        owner than the chain's (a late message of a previous owner) is ignored."""
        chain = self._chains.get(rid)
        if chain is None:
            return 0
        if src_worker is not None and (src_worker, incarnation) != (chain.src_worker, chain.incarnation):
            self._stale += 1
            return 0
        return self._release_chain(chain)

    def expire_orphans(self, now: float | None = None) -> list[str]:
        """Release requests not touched for `orphan_ttl_s` (their writer died without END/DROP)."""
        now = self._clock() if now is None else now
        expired = [c for c in self._chains.values() if now - c.touched > self.orphan_ttl_s]
        for chain in expired:
            self._release_chain(chain)
        self._expired += len(expired)
        return [c.rid for c in expired]

    def _release_chain(self, chain: _Chain) -> int:
        freed = self._drop_tail(chain, 0)
        del self._chains[chain.rid]
        self._dirty.add(chain.rid)
        return freed

    def _drop_tail(self, chain: _Chain, start: int) -> int:
        freed = sum(self._pages.decref(key) for key in reversed(chain.keys[start:]))
        self._tokens_held -= (len(chain.keys) - start) * chain.page_size
        del chain.keys[start:]
        return freed

    # -- queries ----------------------------------------------------------------------------------
    def durable_tokens(self, rid: str) -> int:
        chain = self._chains.get(rid)
        return chain.durable_tokens if chain else 0

    def durable_map(self, limit: int | None = None) -> dict[str, int]:
        """Durable tokens of the requests held, at most `limit` of them (the oldest first)."""
        return {rid: c.durable_tokens for rid, c in itertools.islice(self._chains.items(), limit)}

    def durable_deltas(self) -> dict[str, int]:
        """Durable tokens of every request that changed since the last call (0 = no longer held)."""
        out: dict[str, int] = {}
        for rid in self._dirty:
            tokens = self.durable_tokens(rid)
            if self._reported.get(rid, 0) != tokens:
                out[rid] = tokens
            if tokens:
                self._reported[rid] = tokens
            else:
                self._reported.pop(rid, None)
        self._dirty.clear()
        return out

    def longest_prefix(
        self, token_ids: Sequence[int], page_size: int, prior: str | None = None
    ) -> tuple[int, list[memoryview]]:
        """Restore-by-prefix: (tokens covered, page bytes) of the longest held chain of `token_ids`."""
        data: list[memoryview] = []
        for key in page_keys(token_ids, page_size, prior):
            page = self._pages.data(key)
            if page is None:
                break
            data.append(page)
        return len(data) * page_size, data

    def page(self, key: str) -> memoryview | None:
        return self._pages.data(key)

    def chain(self, rid: str) -> ChainInfo | None:
        c = self._chains.get(rid)
        if c is None:
            return None
        owner = (c.rid, c.src_worker, c.incarnation, c.page_size)
        return ChainInfo(*owner, len(c.keys), c.durable_tokens, c.truncated, c.touched)

    @property
    def bytes_used(self) -> int:
        return self._pages.bytes_used

    def rids(self) -> tuple[str, ...]:
        return tuple(self._chains)

    def stats(self) -> StoreStats:
        return StoreStats(
            budget_bytes=self.budget_bytes,
            bytes_used=self.bytes_used,
            pages=len(self._pages),
            requests=len(self._chains),
            tokens_held=self._tokens_held,
            evicted_pages=self._evicted_pages,
            evicted_requests=self._evicted_requests,
            refused_pages=self._refused,
            deduped_pages=self._deduped,
            stale_messages=self._stale,
            expired_requests=self._expired,
        )

    def check_integrity(self) -> None:
        if self.bytes_used > self.budget_bytes:
            raise IntegrityError(f"bytes_used {self.bytes_used} exceeds budget {self.budget_bytes}")
        refs: dict[str, int] = {}
        tokens = 0
        for c in self._chains.values():
            tokens += c.durable_tokens
            for i, key in enumerate(c.keys):
                refs[key] = refs.get(key, 0) + 1
                parent = c.keys[i - 1] if i else c.prior
                if key in self._pages and self._pages.parent(key) != parent:
                    raise IntegrityError(f"{c.rid}: page {i} parent {self._pages.parent(key)} != {parent}")
        self._pages.check(refs)
        if tokens != self._tokens_held:
            raise IntegrityError(f"chains hold {tokens} tokens but tokens_held is {self._tokens_held}")
