"""Re-homing: when a checkpoint holder dies, the requests it held for get new holders.

Failures the detector finds in one pass are handled together, after the pass, so no checkpoint is
re-homed onto another dying worker; requests are handled oldest first. The new holders are the core's
choice (`gateway.core.holders.reassign_holders`, Algorithm 1 without the holders a request keeps);
the serving worker is told with `AssignHolder` and re-sends the pages it has.
"""

from __future__ import annotations

import asyncio

import structlog

from gateway.core import holders as holder_policy
from gateway.protocol import control_pb2 as pb
from gateway.server.checkpoints import CheckpointManager
from gateway.server.metrics import GatewayMetrics
from gateway.server.workers.control import ControlService

log = structlog.get_logger("lumen.rehoming")


class Rehoming:
    def __init__(
        self,
        *,
        checkpoints: CheckpointManager,
        control: ControlService,
        metrics: GatewayMetrics,
    ) -> None:
        self.checkpoints = checkpoints
        self.control = control
        self.metrics = metrics
        # workers found FAILED and not yet handled: failures detected together are handled together
        self._dead: list[str] = []

    def worker_failed(self, worker_id: str) -> None:
        """A worker failed (the recovery coordinator tells): its checkpoints are re-homed after the
        detector's pass (`holder_failed`)."""
        self._dead.append(worker_id)
        if len(self._dead) > 1:
            return  # already scheduled
        try:
            # after the detector's pass: workers it finds dead in the same pass are all FAILED
            # before any checkpoint is re-homed, so none is re-homed onto another dying worker
            asyncio.get_running_loop().call_soon(self._handle_failed)
        except RuntimeError:  # no event loop (synchronous use): at once
            self._handle_failed()

    def _handle_failed(self) -> None:
        dead, self._dead = self._dead, []
        for wid in dead:
            self.holder_failed(wid)

    def holder_failed(self, dead: str) -> None:
        """Requests whose holder died get a new one, oldest request first; their serving worker
        re-sends the pages."""
        books = self.checkpoints
        for ck in books.held_by(dead):
            if not books.holder_lost(ck, dead):
                continue
            alive = tuple(h for h in ck.holders if books.alive(h))
            new = holder_policy.reassign_holders(
                books.view(), ck.serving, alive, ck.expected_tokens * books.kv_bytes_per_token, books.params
            )
            if not new:
                continue
            books.add_holders(ck, new)
            msg = pb.GatewayMessage(
                assign_holder=pb.AssignHolder(
                    rid=ck.wrid,
                    holders=[
                        pb.HolderTarget(worker_id=h, kv_endpoint=books.ref(h).kv_endpoint) for h in ck.holders
                    ],
                )
            )
            self.control.send(ck.serving, msg)
            self.metrics.ckpt_assignments.labels(outcome="reassigned").inc()
            log.info("holder_reassigned", rid=ck.wrid, dead=dead, new=list(new), serving=ck.serving)
