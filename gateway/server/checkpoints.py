"""The checkpoint manager: which workers hold which request's KV pages (DESIGN 3, 4.4, 6).

It assigns holders with Algorithm 1 when an attempt starts (the serving worker then streams full pages
to them), tracks the durable prefix each holder reports in its heartbeats, keeps the books when a
holder dies (the recovery coordinator's re-homing, recovery/rehoming.py, picks new holders), and
drops everything when the request ends.
Its accounting feeds the load estimate: a holder's checkpoint term is the larger of what it reports
and what the gateway has assigned to it, so a burst of assignments between heartbeats stays balanced.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import structlog

from gateway.core import holders as holder_policy
from gateway.core.dispatch import InterruptedRequest
from gateway.core.health import WorkerState
from gateway.core.types import ClusterView, WorkerView
from gateway.protocol import control_pb2 as pb
from gateway.protocol.generate import HolderRef
from gateway.server.metrics import GatewayMetrics
from gateway.server.workers.control import ControlService
from gateway.server.workers.monitor import LoadMonitor, WorkerRecord

log = structlog.get_logger("lumen.checkpoints")


@dataclass(slots=True)
class Checkpoint:
    """One attempt's checkpoint: its worker-level rid, serving worker, and holders."""

    wrid: str
    session_rid: str
    seq: int  # the session's order of first assignment: holder failures re-home oldest first
    serving: str
    serving_incarnation: int
    expected_tokens: int  # context + remaining: what a holder may end up holding
    # holder id -> durable tokens it reported for this rid
    holders: dict[str, int] = field(default_factory=dict)
    abandoned: bool = False
    # a later attempt of the same request has started: no longer charged or offered for restore;
    # its pages are dropped once that attempt streams (a restore on a holder reads them first)
    retired: bool = False


class _Assigned(defaultdict[str, int]):
    """Tokens assigned per holder (0 when absent), remembering which holders' entries were set or
    deleted since `view()` last looked (`touched`), so that the view is updated for those only.

    Only item assignment (`d[h] = n`, `d[h] += n`) and `del d[h]` are tracked: change it that way.
    """

    def __init__(self) -> None:
        super().__init__(int)
        self.touched: set[str] = set()

    def __setitem__(self, key: str, value: int) -> None:
        super().__setitem__(key, value)
        self.touched.add(key)

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        self.touched.add(key)


class CheckpointManager:
    def __init__(
        self,
        *,
        monitor: LoadMonitor,
        control: ControlService,
        params: holder_policy.HolderParams,
        kv_bytes_per_token: int,
        metrics: GatewayMetrics,
    ) -> None:
        self.monitor = monitor
        self.control = control
        self.params = params
        self.kv_bytes_per_token = kv_bytes_per_token
        self.metrics = metrics
        self.by_wrid: dict[str, Checkpoint] = {}
        self.by_session: dict[str, list[str]] = defaultdict(list)
        # tokens the gateway has assigned to each holder and not yet released
        self.assigned_tokens = _Assigned()
        # view(): the last view made, and the monitor's view it was made from
        self._view: ClusterView | None = None
        self._base: ClusterView | None = None
        self._session_seq: dict[str, int] = {}
        self._next_seq = 0

    # -- the view the policies see --------------------------------------------------------------
    def view(self) -> ClusterView:
        """The monitor's view with each holder's checkpoint term raised to what it was assigned.

        Kept between calls: the same object while nothing changed, else the previous one updated
        (`ClusterView.with_workers`) for the workers whose monitor view or assigned tokens changed.
        """
        base = self.monitor.view()
        cached, prev = self._view, self._base
        touched = self.assigned_tokens.touched
        if cached is None or prev is None or len(base.workers) != len(prev.workers):
            out = ClusterView({wid: self._charged(w) for wid, w in base.workers.items()})
        else:
            if base is not prev:
                changes = self.monitor.view_changes(prev)
                if changes is None:  # not the monitor's previous view: compare worker by worker
                    old = prev.workers
                    changes = tuple(wid for wid, w in base.workers.items() if old.get(wid) is not w)
                touched.update(changes)
            workers = base.workers
            out = cached.with_workers([self._charged(workers[wid]) for wid in touched if wid in workers])
        touched.clear()
        self._view, self._base = out, base
        return out

    def _charged(self, w: WorkerView) -> WorkerView:
        assigned = self.assigned_tokens.get(w.id, 0)
        if assigned > w.ckpt_tokens:
            return w.with_checkpoints(assigned, max(w.ckpt_bytes, assigned * self.kv_bytes_per_token))
        return w

    # -- lifecycle of one attempt's checkpoint --------------------------------------------------
    def assign(
        self, session_rid: str, wrid: str, serving: WorkerRecord, context: int, remaining: int
    ) -> list[HolderRef]:
        self._retire(session_rid)
        expected = context + remaining
        chosen = holder_policy.choose_holders(
            self.view(), serving.id, expected * self.kv_bytes_per_token, self.params
        )
        if not chosen:
            self.metrics.ckpt_assignments.labels(outcome="no_holder").inc()
            return []
        if session_rid not in self._session_seq:
            self._session_seq[session_rid] = self._next_seq
            self._next_seq += 1
        seq = self._session_seq[session_rid]
        ck = Checkpoint(
            wrid, session_rid, seq, serving.id, serving.incarnation, expected, {h: 0 for h in chosen}
        )
        self.by_wrid[wrid] = ck
        self.by_session[session_rid].append(wrid)
        for h in chosen:
            self.assigned_tokens[h] += expected
        self.metrics.ckpt_assignments.labels(outcome="assigned").inc()
        return [self.ref(h) for h in chosen]

    def interrupted(self, session_rid: str, failed: str, context: int, remaining: int) -> InterruptedRequest:
        """What dispatch needs: live holders of the session's checkpoints and the prefix they all have.

        The durable counts come from heartbeats, so they lag the holders' stores: a live holder that
        has reported nothing yet is still offered (with |C_r| = 0), the latest attempt's first.
        """
        best: tuple[int, tuple[str, ...]] = (-1, ())
        for wrid in reversed(self.by_session.get(session_rid, ())):
            ck = self.by_wrid.get(wrid)
            if ck is None or ck.abandoned or ck.retired:
                continue
            live = {h: t for h, t in ck.holders.items() if self.alive(h) and h != failed}
            if not live:
                continue
            # with two holders, the prefix both have (dispatch may pick either)
            durable = min(min(live.values()), context)
            if durable > best[0]:
                best = (durable, tuple(sorted(live)))
        return InterruptedRequest(
            rid=session_rid,
            failed_worker=failed,
            holders=best[1],
            durable_tokens=max(0, best[0]),
            context_tokens=context,
            remaining_tokens=remaining,
        )

    def release_session(self, session_rid: str) -> None:
        """The request ended (finished or failed for good): every holder drops its pages."""
        self._retire(session_rid)
        self._session_seq.pop(session_rid, None)
        self._drop(self.by_session.pop(session_rid, []))

    def drop_retired(self, session_rid: str) -> None:
        """The request's new attempt is streaming: the holders of its earlier attempts drop them."""
        wrids = self.by_session.get(session_rid)
        if not wrids:
            return
        old = [w for w in wrids if (ck := self.by_wrid.get(w)) is not None and ck.retired]
        if old:
            wrids[:] = [w for w in wrids if w not in old]
            self._drop(old)

    def _retire(self, session_rid: str) -> None:
        """Stop charging and offering the session's current checkpoints (the sim does the same)."""
        for wrid in self.by_session.get(session_rid, ()):
            ck = self.by_wrid.get(wrid)
            if ck is None or ck.retired:
                continue
            ck.retired = True
            for h in ck.holders:
                self.assigned_tokens[h] -= ck.expected_tokens
                if self.assigned_tokens[h] <= 0:
                    del self.assigned_tokens[h]

    def _drop(self, wrids: list[str]) -> None:
        drops: dict[str, list[str]] = defaultdict(list)
        for wrid in wrids:
            ck = self.by_wrid.pop(wrid, None)
            if ck is None:
                continue
            for h in ck.holders:
                drops[h].append(wrid)
        for h, rids in drops.items():
            if self.alive(h):
                self.control.send(h, pb.GatewayMessage(drop_checkpoint=pb.DropCheckpoint(rids=rids)))

    # -- feedback from workers ------------------------------------------------------------------
    def on_heartbeat(self, rec: WorkerRecord, hb: pb.Heartbeat) -> None:
        for d in hb.durable:
            ck = self.by_wrid.get(d.rid)
            if ck is not None and rec.id in ck.holders:
                ck.holders[rec.id] = d.tokens
        for wrid in hb.abandoned_checkpoints:
            ck = self.by_wrid.get(wrid)
            if ck is not None and ck.serving == rec.id and not ck.abandoned:
                ck.abandoned = True
                self.metrics.ckpt_assignments.labels(outcome="abandoned").inc()
                log.warning("checkpoint_abandoned", rid=wrid, serving=rec.id, holders=list(ck.holders))

    # -- a holder died (recovery/rehoming.py decides what next) ---------------------------------
    def held_by(self, dead: str) -> list[Checkpoint]:
        """The checkpoints `dead` holds, oldest request first."""
        return sorted((ck for ck in self.by_wrid.values() if dead in ck.holders), key=lambda c: c.seq)

    def holder_lost(self, ck: Checkpoint, dead: str) -> bool:
        """Take `dead` off `ck`'s holders and charges; True when `ck` needs a new holder (its serving
        incarnation still streams, so it can re-send the pages)."""
        del ck.holders[dead]
        if ck.retired:
            return False  # not charged any more, and nobody will restore from it
        self.assigned_tokens[dead] = max(0, self.assigned_tokens.get(dead, 0) - ck.expected_tokens)
        if ck.abandoned:
            return False
        serving = self.monitor.workers.get(ck.serving)
        # otherwise the request itself is interrupted; dispatch uses the holders left
        return (
            serving is not None
            and serving.incarnation == ck.serving_incarnation
            and serving.state is WorkerState.HEALTHY
        )

    def add_holders(self, ck: Checkpoint, new: tuple[str, ...]) -> None:
        for h in new:
            ck.holders[h] = 0
            self.assigned_tokens[h] += ck.expected_tokens

    # -- metrics --------------------------------------------------------------------------------
    def coverage(self, live_wrids: list[str]) -> float | None:
        """Share of in-flight attempts with a live, non-abandoned checkpoint on some holder."""
        if not live_wrids:
            return None
        covered = 0
        for wrid in live_wrids:
            ck = self.by_wrid.get(wrid)
            if ck is not None and not ck.abandoned and any(self.alive(h) for h in ck.holders):
                covered += 1
        return covered / len(live_wrids)

    # -- helpers --------------------------------------------------------------------------------
    def alive(self, wid: str) -> bool:
        w = self.monitor.workers.get(wid)
        return w is not None and w.state in (WorkerState.HEALTHY, WorkerState.SUSPECT)

    def ref(self, wid: str) -> HolderRef:
        return HolderRef(worker_id=wid, kv_endpoint=self.monitor.workers[wid].kv_endpoint)
