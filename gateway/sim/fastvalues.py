"""Faster construction of two frozen core values the simulator makes on every request.

`WorkerView` and `RequestRecord` are frozen slotted dataclasses: their generated `__init__` sets each
field through `object.__setattr__`, which costs ~4 µs for a WorkerView's 13 slots, and the simulator
makes ~4 WorkerViews per request (the gateway's view, refreshed for the workers that changed) and
one RequestRecord. Here each value is built as an instance of a plain class with the very same slots
(an ordinary `__init__`, ~4× faster) whose `__class__` is then set to the frozen class. CPython allows
that assignment between classes with an identical slot layout, and the object is from then on an
ordinary instance of the frozen class: equal to, hashing and printing as one made by its own
constructor (`tests/unit/test_sim_fastvalues.py` checks it field by field). The import-time checks
below refuse to run if a field is ever added, removed or reordered in the core without this module.
"""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING, cast

from gateway.core.evaluation import RequestRecord
from gateway.core.health import WorkerState
from gateway.core.types import WorkerView

if TYPE_CHECKING:
    from gateway.sim.worker import SimWorker


class _WorkerViewSlots:
    __slots__ = (
        "ckpt_budget_bytes",
        "ckpt_bytes",
        "ckpt_tokens",
        "failure_domain",
        "id",
        "incarnation",
        "kv_capacity_tokens",
        "kv_tokens_used",
        "load_memo",
        "pending",
        "running",
        "state",
        "waiting",
    )

    def __init__(
        self,
        wid: str,
        state: WorkerState,
        incarnation: int,
        running: int,
        waiting: int,
        kv_tokens_used: int,
        kv_capacity_tokens: int,
        ckpt_tokens: int,
        ckpt_bytes: int,
        ckpt_budget_bytes: int,
        failure_domain: str,
        pending: int,
    ) -> None:
        self.id = wid
        self.state = state
        self.incarnation = incarnation
        self.running = running
        self.waiting = waiting
        self.kv_tokens_used = kv_tokens_used
        self.kv_capacity_tokens = kv_capacity_tokens
        self.ckpt_tokens = ckpt_tokens
        self.ckpt_bytes = ckpt_bytes
        self.ckpt_budget_bytes = ckpt_budget_bytes
        self.failure_domain = failure_domain
        self.pending = pending
        self.load_memo = None  # WorkerView's init=False field, as its own __init__ sets it


class _RequestRecordSlots:
    __slots__ = (
        "arrival",
        "error",
        "first_token",
        "interrupted",
        "last_token",
        "output_tokens",
        "resume_delay",
    )

    def __init__(
        self,
        arrival: float,
        first_token: float | None,
        last_token: float | None,
        output_tokens: int,
        interrupted: bool,
        error: bool,
        resume_delay: float | None,
    ) -> None:
        self.arrival = arrival
        self.first_token = first_token
        self.last_token = last_token
        self.output_tokens = output_tokens
        self.interrupted = interrupted
        self.error = error
        self.resume_delay = resume_delay


def _check_layout(twin: type, frozen: type) -> None:
    """The twin must have exactly the frozen class's slots (CPython lays slots out in sorted order, and
    refuses the `__class__` assignment unless both classes have the same ones)."""
    names = sorted(f.name for f in fields(frozen))
    if sorted(twin.__slots__) != names or sorted(frozen.__slots__) != names:  # type: ignore[attr-defined]
        raise ImportError(
            f"{twin.__name__} lacks {frozen.__name__}'s slots: update gateway/sim/fastvalues.py"
        )


_check_layout(_WorkerViewSlots, WorkerView)
_check_layout(_RequestRecordSlots, RequestRecord)


def worker_view(
    w: SimWorker,
    running: int,
    waiting: int,
    kv_tokens_used: int,
    kv_capacity_tokens: int,
    pending: int,
) -> WorkerView:
    """`WorkerView(w.id, w.state, w.incarnation, running, waiting, kv_tokens_used, kv_capacity_tokens,
    w.ckpt_tokens, w.ckpt_bytes, w.ckpt_budget_bytes, w.domain, pending)`, faster."""
    v = _WorkerViewSlots(
        w.id,
        w.state,
        w.incarnation,
        running,
        waiting,
        kv_tokens_used,
        kv_capacity_tokens,
        w.ckpt_tokens,
        w.ckpt_bytes,
        w.ckpt_budget_bytes,
        w.domain,
        pending,
    )
    v.__class__ = WorkerView  # type: ignore[assignment]
    return cast(WorkerView, v)


def request_record(
    arrival: float,
    first_token: float | None,
    last_token: float | None,
    output_tokens: int,
    interrupted: bool,
    error: bool,
    resume_delay: float | None,
) -> RequestRecord:
    """`RequestRecord(...)` with the same arguments and the same validation (`__post_init__`), faster."""
    r = _RequestRecordSlots(arrival, first_token, last_token, output_tokens, interrupted, error, resume_delay)
    r.__class__ = RequestRecord  # type: ignore[assignment]
    record = cast(RequestRecord, r)
    record.__post_init__()
    return record
