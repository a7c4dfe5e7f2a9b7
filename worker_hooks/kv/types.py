"""Values the checkpoint store hands out: frozen, slotted, safe to pass across modules."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HoldResult:
    accepted: int  # pages now held for the request from this call (new or deduplicated)
    deduped: int  # of which were already in the store under another request
    refused: int  # pages not held: no room within the budget
    stale: bool = False  # from a superseded incarnation: ignored
    gap: bool = False  # does not continue the chain held for the request: ignored
    evicted: tuple[str, ...] = ()  # requests evicted to make room


@dataclass(frozen=True, slots=True)
class ChainInfo:
    rid: str
    src_worker: str
    incarnation: int
    page_size: int
    pages: int
    durable_tokens: int
    truncated: bool
    last_touched: float


@dataclass(frozen=True, slots=True)
class StoreStats:
    budget_bytes: int
    bytes_used: int
    pages: int
    requests: int
    tokens_held: int
    evicted_pages: int
    evicted_requests: int
    refused_pages: int
    deduped_pages: int
    stale_messages: int
    expired_requests: int
