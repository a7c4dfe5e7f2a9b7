"""Values that cross module boundaries in the core: immutable, slotted, explicit about absence."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from gateway.core.health import WorkerState

WorkerId = str


class ParamError(ValueError):
    """A policy parameter out of its bounds; `field` names it, so a shell can name its own config key.

    The core parameter dataclasses own every policy default and bound: config sections and simulator
    scenarios take their defaults from them and validate by constructing them.
    """

    def __init__(self, field: str, value: object, why: str) -> None:
        super().__init__(f"{field} = {value!r}: {why}")
        self.field = field
        self.value = value
        self.why = why


def check(ok: bool, field: str, value: object, why: str) -> None:
    """Raise ParamError(field, value, why) unless `ok`."""
    if not ok:
        raise ParamError(field, value, why)


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
    # a memo, not part of the value: (params, L̂, older params, its L̂) of the last two
    # `estimated_load` of this view (gateway.core.load); excluded from init, repr, equality and
    # hashing, and not carried by replace
    load_memo: tuple[LoadParams, float, LoadParams | None, float] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def with_checkpoints(self, ckpt_tokens: int, ckpt_bytes: int) -> WorkerView:
        """`dataclasses.replace(self, ckpt_tokens=..., ckpt_bytes=...)`, several times faster."""
        return WorkerView(
            self.id,
            self.state,
            self.incarnation,
            self.running,
            self.waiting,
            self.kv_tokens_used,
            self.kv_capacity_tokens,
            ckpt_tokens,
            ckpt_bytes,
            self.ckpt_budget_bytes,
            self.failure_domain,
            self.pending,
        )


class Derived(Protocol):
    """A table computed from a view and kept with it (see `ClusterView.derived`).

    `derive` returns the same table for `view.with_workers(...)`, given the old and new version of
    every worker that changed (old None: a new worker), or None when it cannot (it is then rebuilt
    on first use). `update` is the same for `view.update_in_place(...)`: it changes the table itself
    and returns False when it cannot (the table is then dropped and rebuilt on first use).
    """

    def derive(self, changes: list[tuple[WorkerView | None, WorkerView]]) -> Derived | None: ...

    def update(self, changes: list[tuple[WorkerView | None, WorkerView]]) -> bool: ...


@dataclass(frozen=True, slots=True)
class ClusterView:
    """A snapshot of every worker, keyed by worker id; policies are pure functions of it.

    A view is a value: its `workers` mapping must not be changed once the view is made, because the
    policies cache tables computed from it in `derived` (the serving workers ordered by load, the
    ring order). To change a few workers, make a new view with `with_workers`, which carries those
    tables over incrementally instead of recomputing them.
    """

    workers: Mapping[WorkerId, WorkerView] = field(default_factory=dict)
    # tables derived from `workers`, keyed by what they depend on (e.g. the LoadParams); a cache,
    # not part of the value
    derived: dict[object, Derived] = field(default_factory=dict, init=False, repr=False, compare=False)

    @staticmethod
    def of(workers: Iterable[WorkerView]) -> ClusterView:
        return ClusterView({w.id: w for w in workers})

    def in_states(self, states: frozenset[WorkerState]) -> list[WorkerView]:
        return [w for w in self.workers.values() if w.state in states]

    def with_workers(self, changed: Iterable[WorkerView]) -> ClusterView:
        """This view with `changed` workers added or replaced (by id; the last of an id wins).

        Equal to `ClusterView({**self.workers, **{w.id: w for w in changed}})`, but the tables
        derived from this view are updated for the changed workers instead of being rebuilt.
        """
        new = {w.id: w for w in changed}
        if not new:
            return self
        old = self.workers
        workers = dict(old)
        workers.update(new)
        view = ClusterView(workers)
        if self.derived:
            changes = [(old.get(wid), w) for wid, w in new.items()]
            tables = view.derived
            for key, table in self.derived.items():
                updated = table.derive(changes)
                if updated is not None:
                    tables[key] = updated
        return view

    def update_in_place(self, changed: Iterable[WorkerView]) -> None:
        """Make this view `self.with_workers(changed)`, in place, for a shell that owns it alone.

        A view is a value (see the class): only a shell that keeps no other reference to it, nor to
        its workers mapping or its derived tables, across the call may use this. The simulator owns
        its gateway's view this way and refreshes it for a few workers per decision, which then costs
        no copy of the mapping and of each ranked table (`with_workers` copies both, so that views
        already handed out stay as they were: what the live gateway needs). The result equals the
        one `with_workers` gives, derived tables included (`tests/unit/test_core_view_update.py`).
        """
        workers = self.workers
        if not isinstance(workers, dict):
            raise TypeError("update_in_place needs a view whose workers mapping is a dict")
        # applied one at a time, so a later version of an id sees the earlier one as its old version:
        # the tables end as with_workers leaves them (the last version of each id wins)
        changes: list[tuple[WorkerView | None, WorkerView]] = []
        for w in changed:
            changes.append((workers.get(w.id), w))
            workers[w.id] = w
        if changes and self.derived:
            tables = self.derived
            for key, table in list(tables.items()):
                if not table.update(changes):
                    del tables[key]


@dataclass(frozen=True, slots=True)
class LoadParams:
    """Weights of the recovery-load estimate `L̂(w) = α·ckpt(w) + β·queue(w)`."""

    alpha: float = 1.0
    beta: float = 1.0
    nominal_batch: int = 32

    def __post_init__(self) -> None:
        check(self.alpha >= 0, "alpha", self.alpha, "must be >= 0")
        check(self.beta >= 0, "beta", self.beta, "must be >= 0")
        check(self.nominal_batch >= 1, "nominal_batch", self.nominal_batch, "must be >= 1")
