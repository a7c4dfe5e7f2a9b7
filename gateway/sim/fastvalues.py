"""Cheaper forms of two frozen core values the simulator would otherwise make on every request.

`WorkerView` and `RequestRecord` are frozen slotted dataclasses: their generated `__init__` sets each
field through `object.__setattr__`. The simulator refreshes ~4 workers of its gateway's view per
request: instead of a new WorkerView for each, it keeps one `SeenWorker` per worker (a WorkerView
subclass it may change in place) and sets the fields that change (seen.py). It makes one
RequestRecord per request: built as an instance of a plain class with the very same slots (an
ordinary `__init__`, ~4× faster) whose `__class__` is then set to the frozen class.
CPython allows that assignment between classes with an identical slot layout, and the object is from
then on an ordinary instance of the frozen class: equal to, hashing and printing as one made by its
own constructor (`tests/unit/test_sim_fastvalues.py` checks it field by field). The import-time check
below refuses to run if a field is ever added, removed or reordered in the core without this module.
"""

from __future__ import annotations

from dataclasses import fields
from typing import cast

from gateway.core.evaluation import RequestRecord
from gateway.core.types import WorkerView


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


_check_layout(_RequestRecordSlots, RequestRecord)


def _seen_worker() -> type[WorkerView]:
    """The class of the simulated gateway's entries: `SeenWorker` below, or, where the core's
    WorkerView is compiled (gateway/sim/native.py), WorkerView itself: an interpreted class cannot
    subclass a compiled one, and need not, as seen.py, compiled too, then writes an entry's fields
    directly (no frozen check runs)."""
    if hasattr(WorkerView, "__mypyc_attrs__"):
        return WorkerView

    class SeenWorker(WorkerView):
        """A WorkerView its sole owner changes in place: the simulated gateway's entry for one worker.

        The coordinator keeps one per worker in its view and sets the fields of the workers that
        changed before a decision (`SeenCluster.view`, seen.py), instead of making a new WorkerView
        for each change. It is a WorkerView in every other respect (fields, methods, `L̂` memo);
        equality holds only between two SeenWorkers. Only a shell that owns the view alone, and keeps
        no WorkerView of it across a change, may use it (the simulator: every decision reads the view
        and returns).
        """

        __slots__ = ()
        __setattr__ = object.__setattr__  # plain slot assignment (the frozen class refuses it)
        __delattr__ = object.__delattr__

    SeenWorker.__qualname__ = "SeenWorker"  # (its repr)
    return SeenWorker


SeenWorker = _seen_worker()


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
