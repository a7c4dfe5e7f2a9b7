"""Which checkpoints a full store gives up first (DESIGN 4.4). Pure: orders candidates, frees nothing.

- `shortest_prefix_first`: requests with the fewest durable tokens go first; a short prefix is cheap
  for a survivor to recompute, a long one is what checkpointing exists to save. Ties: least recently
  touched, then oldest.
- `lru`: least recently touched request first, then oldest.
- `none`: nothing is evicted; the store refuses the new page and truncates the writer's checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar

from gateway.protocol.launch import Eviction

__all__ = ["Eviction", "eviction_order"]


class Candidate(Protocol):
    @property
    def durable_tokens(self) -> int: ...
    @property
    def touched(self) -> float: ...
    @property
    def seq(self) -> int: ...


C = TypeVar("C", bound=Candidate)


def eviction_order(policy: Eviction, candidates: Iterable[C]) -> list[C]:
    """Candidates in the order the policy evicts them (empty for `none`)."""
    if policy is Eviction.NONE:
        return []
    if policy is Eviction.LRU:
        return sorted(candidates, key=lambda c: (c.touched, c.seq))
    return sorted(candidates, key=lambda c: (c.durable_tokens, c.touched, c.seq))
