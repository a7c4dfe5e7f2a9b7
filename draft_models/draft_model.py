"""What the drafter server asks of a draft model (`DraftModel`), and the types it deals in.

A draft model keeps one `DraftState` per request: `start` builds it from a context, `sync` folds in
the ids the target really accepted, and `propose` drafts k tokens without moving it (drafts are
speculative). Implementations: the synthetic drafter (synthetic_drafter.py) and a real torch model
(torch_drafter.py); the drafter server is drafter.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from draft_models.distribution import Dist
from models.synthetic import Sampler


class DraftState:
    """One request's drafting state: the context hash and length after the ids synced so far."""

    __slots__ = ("h", "position")

    def __init__(self, h: int, position: int) -> None:
        self.h = h
        self.position = position


@dataclass(frozen=True, slots=True)
class Proposal:
    tokens: tuple[int, ...]
    q: tuple[Dist, ...] | None  # per draft token, when asked for


class DraftModel(Protocol):
    def start(self, context: Sequence[int]) -> DraftState: ...

    def sync(self, state: DraftState, tokens: Sequence[int]) -> None: ...

    def propose(self, state: DraftState, k: int, sampler: Sampler, *, want_q: bool = False) -> Proposal: ...
