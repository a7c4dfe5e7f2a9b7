"""The worker's two draft-assist roles, as the gateway commands them (StartDraftAssist, StopDraftAssist).

- Drafter (`drafter`): only a restarting worker with a draft model has one (drafting.py); it drafts
  while DRAFT_READY for the target the gateway pairs it with, and retires once the full model serves.
- Target (`speculator`): any worker may be assisted by one drafter at a time (speculative.py); a new
  StartDraftAssist replaces the current drafter. StopDraftAssist, a new incarnation or shutdown end the
  pair and the worker decodes alone again.

The target's assist counts (heartbeat DraftStats) add up over every pair of this process.
"""

from __future__ import annotations

import structlog

from gateway.core.costmodel import CostModel
from gateway.core.draftpairs import check_pair
from gateway.protocol.launch import EngineSpec
from gateway.protocol.planes import PlaneAuth, Security
from worker_hooks.engine.checkpointing import valid_endpoint
from worker_hooks.engine.drafting import DrafterRole
from worker_hooks.engine.speculative import AssistTotals, Speculator

log = structlog.get_logger(__name__)


class Assist:
    def __init__(
        self, spec: EngineSpec, worker_id: str, cost: CostModel, *, drafter: bool, auth: Security
    ) -> None:
        if spec.draft_model:
            check_pair(spec.model, spec.draft_model)  # IncompatibleDraftError: a ValueError
        self.spec = spec
        self.worker_id = worker_id
        self.cost = cost
        self.auth = auth
        self.drafter = DrafterRole.for_spec(spec, worker_id, auth=auth) if drafter else None
        # the draft model's cost model, for choosing k: the same draft preset on every worker
        self.draft_cost: CostModel | None = None
        if self.drafter is not None:
            self.draft_cost = self.drafter.cost
        elif spec.draft_model:
            self.draft_cost = CostModel.preset(spec.draft_model, spec.gpu)
        self.speculator: Speculator | None = None
        self._ended = AssistTotals()  # the counts of pairs that ended

    async def start(self) -> None:
        if self.drafter is not None:
            await self.drafter.start()

    async def close(self) -> None:
        self.end("worker shutting down")
        if self.drafter is not None:
            await self.drafter.close()

    @property
    def endpoint(self) -> str:
        """Where this worker's drafter answers ("" when it runs none)."""
        return self.drafter.endpoint if self.drafter is not None else ""

    # -- commands -------------------------------------------------------------------------------
    def start_pair(self, peer_id: str, peer_endpoint: str, role: str, k: int, peer_key: str = "") -> bool:
        """StartDraftAssist; returns whether it was applied. `peer_key`: the drafter's CURVE server key
        (a target's; else the member table's key for its endpoint)."""
        if role == "drafter":
            if self.drafter is None or not self.drafter.endpoint:
                log.warning("not a drafter; StartDraftAssist ignored", worker_id=self.worker_id, peer=peer_id)
                return False
            self.drafter.paired(peer_id, k)
            return True
        if role != "target" or not valid_endpoint(peer_endpoint):
            log.warning("StartDraftAssist refused", peer=peer_id, role=role, endpoint=peer_endpoint)
            return False
        auth = self.auth
        if isinstance(auth, PlaneAuth):
            peer_key = peer_key or auth.members.server_key(peer_endpoint) or ""
            if not peer_key:
                log.warning(
                    "StartDraftAssist refused: no key for the drafter", peer=peer_id, endpoint=peer_endpoint
                )
                return False
        self.end(f"replaced by {peer_id}")
        s = self.spec
        self.speculator = Speculator(
            peer_id,
            peer_endpoint,
            auth=auth,
            server_key=peer_key,
            k=k or s.draft_k_min,
            k_min=s.draft_k_min,
            k_max=s.draft_k_max,
            timeout_s=s.draft_timeout_ms / 1000.0,
            cost=self.cost,
            draft_cost=self.draft_cost,
            time_scale=s.time_scale,
        )
        log.info(
            "draft assist started", worker_id=self.worker_id, drafter=peer_id, endpoint=peer_endpoint, k=k
        )
        return True

    def stop_pair(self, peer_id: str) -> None:
        """StopDraftAssist: end the pair with `peer_id`, in whichever role this worker has in it."""
        if self.speculator is not None and self.speculator.peer_id == peer_id:
            self.end("stopped by the gateway")
        if self.drafter is not None and peer_id in self.drafter.peers:
            self.drafter.unpaired(peer_id)

    def reset(self) -> None:
        """A new incarnation: the gateway has dropped every pair of the old one without telling us."""
        self.end("incarnation reset")
        if self.drafter is not None:
            self.drafter.forget_pairs()

    def end(self, reason: str) -> None:
        sp, self.speculator = self.speculator, None
        if sp is None:
            return
        totals = sp.totals()
        self._ended += totals
        sp.close()
        log.info(
            "draft assist ended",
            worker_id=self.worker_id,
            drafter=sp.peer_id,
            reason=reason,
            drafted=totals.drafted,
            accepted=totals.accepted,
            steps=totals.rounds,
            acceptance=sp.client.stats.acceptance,
        )

    # -- reports --------------------------------------------------------------------------------
    def plane_refusals(self) -> dict[str, int]:
        """What this worker's drafter refused on the draft plane ({} without a drafter)."""
        return self.drafter.plane_refusals() if self.drafter is not None else {}

    def totals(self) -> AssistTotals:
        """This worker's counts as a target, over every pair so far."""
        sp = self.speculator
        return self._ended + sp.totals() if sp is not None else self._ended
