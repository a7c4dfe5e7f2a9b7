"""Routing of new requests: least estimated load among HEALTHY workers, ties broken by id."""

from __future__ import annotations

from collections.abc import Collection

from gateway.core.health import SERVING_STATES
from gateway.core.load import estimated_load
from gateway.core.types import ClusterView, LoadParams, WorkerId


def choose_worker(
    view: ClusterView, params: LoadParams, exclude: Collection[WorkerId] = ()
) -> WorkerId | None:
    """The HEALTHY worker with the least `L̂` (ties by id), or None when there is none.

    The result does not depend on the order of workers in the view.
    """
    best: tuple[float, WorkerId] | None = None
    for w in view.workers.values():
        if w.state not in SERVING_STATES or w.id in exclude:
            continue
        key = (estimated_load(w, params), w.id)
        if best is None or key < best:
            best = key
    return None if best is None else best[1]
