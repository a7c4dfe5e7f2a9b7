"""Values that cross module boundaries in the core: immutable, slotted, explicit about absence."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gateway.core.health import WorkerState

WorkerId = str


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One worker as the gateway last saw it (from its Hello and heartbeats)."""

    id: WorkerId
    state: WorkerState
    incarnation: int
    running: int = 0
    waiting: int = 0
    kv_tokens_used: int = 0
    kv_capacity_tokens: int = 1
    # KV tokens of other workers' requests this worker holds as checkpoints
    ckpt_tokens: int = 0
    ckpt_bytes: int = 0
    ckpt_budget_bytes: int = 0
    failure_domain: str = ""
    # requests the gateway has routed here but the worker has not yet reported
    pending: int = 0


@dataclass(frozen=True, slots=True)
class ClusterView:
    """A snapshot of every worker; policies are pure functions of it."""

    workers: Mapping[WorkerId, WorkerView] = field(default_factory=dict)

    @staticmethod
    def of(workers: Iterable[WorkerView]) -> ClusterView:
        return ClusterView({w.id: w for w in workers})

    def in_states(self, states: frozenset[WorkerState]) -> list[WorkerView]:
        return [w for w in self.workers.values() if w.state in states]


@dataclass(frozen=True, slots=True)
class LoadParams:
    """Weights of the recovery-load estimate `L̂(w) = α·ckpt(w) + β·queue(w)`."""

    alpha: float = 1.0
    beta: float = 1.0
    nominal_batch: int = 32
