"""The load monitor's ClusterView, remade only for the workers whose records changed.

The policies read the view for their decisions and keep tables derived from it (ranked loads,
`ClusterView.derived`). The view is kept while no worker changes, and updated with `with_workers`
(which carries those tables over incrementally) for the records that report a change: each record
reports the first write to a field its WorkerView is made of (`WorkerRecord.__setattr__`) to the
list this cache tracks.
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.core.types import ClusterView
from gateway.server.workers.records import WorkerRecord


class ViewCache:
    def __init__(self) -> None:
        # the ClusterView last made by view(), and the records changed since (see WorkerRecord)
        self._view: ClusterView | None = None
        self._changed: list[WorkerRecord] = []
        # the view before the last one, and the ids view() updated from it (None: rebuilt)
        self._prev_view: ClusterView | None = None
        self._prev_changes: tuple[str, ...] | None = None

    def track(self, rec: WorkerRecord) -> None:
        """A new record: it reports its changes here, and is one itself."""
        rec._changed = self._changed
        self._changed.append(rec)

    def invalidate(self) -> None:
        """The next view is rebuilt (records were dropped: `with_workers` only adds and updates)."""
        self._view = None

    def view(self, workers: Mapping[str, WorkerRecord]) -> ClusterView:
        """Every worker in `workers` as the gateway sees it now.

        The same ClusterView object while no worker changed; otherwise the previous one updated for
        the workers whose records changed (`ClusterView.with_workers`, which keeps the policies'
        ranked load tables), rebuilt from scratch only when workers were added.
        """
        cv, changed = self._view, self._changed
        if not changed and cv is not None and len(cv.workers) == len(workers):
            return cv
        ids: tuple[str, ...] | None = None
        if cv is None or len(cv.workers) != len(workers) or len(changed) > 4 * len(workers):
            new = ClusterView({w.id: w.view() for w in workers.values()})
        else:
            # records of replaced incarnations may still change (a session's inflight): not ours
            views = [rec.view() for rec in changed if workers.get(rec.id) is rec]
            new = cv.with_workers(views)
            ids = tuple(w.id for w in views)
        changed.clear()
        if new is not cv:
            self._prev_view, self._prev_changes, self._view = cv, ids, new
        return new

    def view_changes(self, since: ClusterView) -> tuple[str, ...] | None:
        """The ids of the workers that may differ between `since` and the current view when `since`
        is the view before it; None otherwise (compare them yourself)."""
        if since is self._prev_view and self._prev_changes is not None:
            return self._prev_changes
        return None
