"""The simulated gateway's view of its workers: one entry per worker, changed in place.

The gateway's view is exact at each decision (no heartbeat lag), except that a dead worker keeps the
load it had when it died, plus what was sent to it since, until the failure is detected. Workers
report their changes (`SimWorker.mark_dirty`) and `view()` refreshes only those.

A WorkerView is a frozen value; this module alone changes the simulated gateway's entries, because
it owns its view alone: no decision keeps a view or an entry across a change (every decision reads
the view and returns). The live gateway makes a new WorkerView for every change. Interpreted, the
entries are `fastvalues.SeenWorker`s, which allow assignment; compiled (gateway/sim/native.py), an
assignment here is a direct write that no frozen check sees, and the entries are WorkerViews.
"""

from __future__ import annotations

from gateway.core.load import LoadTable
from gateway.core.types import ClusterView, WorkerView
from gateway.sim.fastvalues import SeenWorker
from gateway.sim.worker import SimWorker


class SeenCluster:
    def __init__(self, workers: list[SimWorker]) -> None:
        self.workers = workers
        self._dirty: list[SimWorker] = []  # workers marked dirty since view() last ran
        self._view = ClusterView()
        self.refresh_all()

    def refresh_all(self) -> None:
        """Rebuild the view of every worker (each worker then reports its changes: `mark_dirty`)."""
        self._dirty.clear()
        for w in self.workers:
            w.dirty_sink = self._dirty
            w.dirty = False
        seen = {w.id: self._view_of(w) for w in self.workers}
        for w in self.workers:
            w.seen = seen[w.id]
        self._view = ClusterView(seen)

    def _view_of(self, w: SimWorker) -> WorkerView:
        """A new entry for w, as it is now (one per worker, changed in place from then on)."""
        return SeenWorker(
            w.id,
            w.state,
            w.incarnation,
            w.running,
            len(w.waiting),
            w.kv_used,
            w.kv_capacity,
            w.ckpt_tokens,
            w.ckpt_bytes,
            w.ckpt_budget_bytes,
            w.domain,
            0,  # the simulated gateway sees every worker's queue at once: nothing is unreported
        )

    def view(self) -> ClusterView:
        """The gateway's view: the previous one updated for the workers marked dirty since.

        The coordinator is the view's sole owner (no decision keeps a view or one of its workers), so
        it changes each dirty worker's entry in place, then moves it in the policies'
        ranked load tables, as `ClusterView.update_in_place` does (given the same entry as old and
        new: the tables read a worker's old `L̂` from their own books, not from its old entry). A
        decision costs O(changed workers), not O(workers), and no new WorkerView.
        """
        dirty = self._dirty
        if not dirty:
            return self._view
        # (entry, entry) per changed worker: the derived tables' `update` (`Derived`), with each entry
        # as its old and its new version (already in the view's mapping, changed in place)
        changes: list[tuple[WorkerView | None, WorkerView]] = []
        for w in dirty:
            if not w.dirty:
                continue  # refreshed since it was marked (freeze)
            w.dirty = False
            v = w.seen
            assert v is not None
            # set only the fields that changed (interpreted, a read costs less than a set). moved: a
            # field the derived tables read changed (L̂'s inputs, the state; `LoadTable`, the holders'
            # ring of ids): only then do they see the entry, and only then is estimated_load's memo
            # of the old values dropped
            moved = False
            if w.alive:
                running, waiting = w.running, len(w.waiting)
                was_running, was_waiting, was_pending = v.running, v.waiting, v.pending
                if was_running != running:
                    v.running = running  # type: ignore[misc]
                if was_waiting != waiting:
                    v.waiting = waiting  # type: ignore[misc]
                if was_pending:
                    v.pending = 0  # type: ignore[misc]
                # an admission moves a request from waiting to running: L̂ reads only the sum
                moved = was_running + was_waiting + was_pending != running + waiting
                if v.kv_tokens_used != w.kv_used:
                    v.kv_tokens_used = w.kv_used  # type: ignore[misc]
            else:  # the gateway still sees the load it had when it died (`freeze`)
                pending = len(w.lost) - w.lost_at_kill  # sent to it since it died
                if v.pending != pending:
                    v.pending = pending  # type: ignore[misc]
                    moved = True
            if v.ckpt_tokens != w.ckpt_tokens or v.ckpt_bytes != w.ckpt_bytes:
                v.ckpt_tokens = w.ckpt_tokens  # type: ignore[misc]
                v.ckpt_bytes = w.ckpt_bytes  # type: ignore[misc]
                moved = True
            if v.state is not w.state or v.incarnation != w.incarnation:
                v.state = w.state  # type: ignore[misc]
                v.incarnation = w.incarnation  # type: ignore[misc]
                moved = True
            if moved and v.load_memo is not None:
                v.load_memo = None  # type: ignore[misc]
            if moved:
                changes.append((v, v))
        dirty.clear()
        view = self._view
        tables = view.derived
        if changes and tables:  # ClusterView.update_in_place without its mapping's updates
            dropped = None  # (a loop, not a comprehension: no frame of its own per refresh)
            for key, table in tables.items():
                if isinstance(table, LoadTable):  # noqa: SIM108  (a direct call where compiled)
                    kept = table.update(changes)
                else:
                    kept = table.update(changes)
                if not kept:
                    dropped = [key] if dropped is None else [*dropped, key]
            if dropped is not None:
                for key in dropped:
                    del tables[key]
        return view

    def freeze(self, w: SimWorker) -> None:
        """A worker just died: the gateway keeps seeing its last load until it detects the failure."""
        v = w.seen
        assert v is not None
        v.state = w.state  # type: ignore[misc]
        v.incarnation = w.incarnation  # type: ignore[misc]
        v.running = w.running  # type: ignore[misc]
        v.waiting = len(w.waiting)  # type: ignore[misc]
        v.kv_tokens_used = w.kv_used  # type: ignore[misc]
        v.pending = 0  # type: ignore[misc]
        v.ckpt_tokens = w.ckpt_tokens  # type: ignore[misc]
        v.ckpt_bytes = w.ckpt_bytes  # type: ignore[misc]
        v.load_memo = None  # type: ignore[misc]
        self._view.update_in_place((v,))
        w.dirty = False
