"""Lumen's worker on the control plane: its engine as an `AgentRole` of the shared client (DESIGN 4.3).

The session logic (Hello/Welcome/Refuse, heartbeats by absolute deadlines, backoff, re-attach after a
fence) is `worker_hooks.control.ControlClient`, shared with the SGLang sidecar; this module says what
Lumen's engine reports and does.

When a session the gateway answered ends, the engine resets its incarnation (aborting the requests the
gateway sent under the old one) before the agent re-attaches.

Heartbeats carry the checkpoint plane's state in modelled bytes: the store's use, the durable tokens
of every held request that changed since the previous beat (all of them in a session's first beat,
so a restarted gateway learns the whole state), and the checkpoints the sender abandoned; and the
worker's draft-assist totals as a target (`DraftStats`: drafts verified, accepted, assisted steps).

Hello carries the worker's plane key (its CURVE public key, gateway/protocol/planes.py); the gateway's
`Members` command replaces the table of peers its KV store and drafter admit and its senders trust.

Hello carries `draft_endpoint` while the worker runs a drafter: a restarting worker with a draft model
binds its drafter before it attaches, so the gateway knows where to send targets once it reports
DRAFT_READY. StartDraftAssist / StopDraftAssist go to the engine's assist roles.
"""

from __future__ import annotations

import os

import structlog

from gateway.protocol import control_pb2 as pb
from gateway.protocol.launch import EngineSpec
from worker_hooks.control import (
    BACKOFF_CAP_S,
    BACKOFF_START_S,
    WELCOME_TIMEOUT_S,
    ControlClient,
    SessionEnded,
)
from worker_hooks.engine.engine import Engine

__all__ = ["Agent", "EngineRole", "SessionEnded"]

log = structlog.get_logger(__name__)


class EngineRole:
    """Lumen's engine as the control plane sees it (an `AgentRole`)."""

    def __init__(self, spec: EngineSpec, engine: Engine, http_url: str) -> None:
        self.spec = spec
        self.engine = engine
        self.http_url = http_url
        # the control sessions with the cluster's other gateways (same engine): after a reset they
        # must say Hello again, with the new incarnation
        self.siblings: list[ControlClient] = []
        # whose grants (SetAdmission) are this session's: the gateway's address (Agent sets it)
        self.source = ""
        self._reported: object = None  # the reload report this gateway was sent

    @property
    def worker_id(self) -> str:
        return self.engine.worker_id

    @property
    def incarnation(self) -> int:
        return self.engine.incarnation

    def hello(self) -> pb.Hello:
        spec, engine = self.spec, self.engine
        return pb.Hello(
            worker_id=engine.worker_id,
            model=spec.model,
            draft_model=spec.draft_model,
            http_url=self.http_url,
            kv_endpoint=engine.ckpt.endpoint,
            draft_endpoint=engine.assist.endpoint,
            kv_capacity_tokens=engine.pool.capacity_tokens,
            ckpt_budget_bytes=engine.ckpt.stats().budget_bytes,
            failure_domain=spec.failure_domain,
            page_size=spec.page_size,
            pid=os.getpid(),
            max_running_requests=spec.max_running_requests,
            phase=pb.Phase.Value(engine.phase.value),
            plane_key=engine.planes.keys.public,
            tp=engine.cost.tp,
            awaiting_seed=engine.seeding.awaiting,
        )

    def heartbeat(self, seq: int, *, full: bool) -> pb.Heartbeat:
        """The engine's state now; `full` reports every held checkpoint, not only the changes."""
        s = self.engine.stats()
        ckpt = self.engine.ckpt
        c = ckpt.stats()
        d = self.engine.assist.totals()
        hb = pb.Heartbeat(
            seq=seq,
            phase=pb.Phase.Value(s.phase.value),
            running=s.running,
            waiting=s.waiting,
            kv_tokens_used=s.kv_tokens_used,
            completed_total=s.completed_total,
            ckpt_bytes_used=c.bytes_used,
            ckpt_tokens_held=c.tokens_held,
            durable=[pb.DurableTokens(rid=r, tokens=t) for r, t in ckpt.durable(full=full).items()],
            abandoned_checkpoints=ckpt.abandoned(),
            restored_tokens_total=c.restored_tokens,
            ckpt_bytes_sent_total=c.bytes_sent,
            ckpt_pages_evicted_total=c.pages_evicted,
            restores_total=c.restores,
            draft=pb.DraftStats(drafted_tokens=d.drafted, accepted_tokens=d.accepted, rounds=d.rounds),
            batch_limit=s.max_running_requests,
            awaiting_seed=self.engine.seeding.awaiting,
        )
        report = self.engine.seeding.report
        if report is not None and self._reported is not report:  # once to each gateway (seeding.py)
            self._reported = report
            hb.reload_seconds, hb.reload_source, hb.reload_seed = report.seconds, report.source, report.seed
        return hb

    def welcomed(self, welcome: pb.Welcome) -> None:
        if welcome.skip_draft:
            self.engine.skip_draft()

    def command(self, msg: pb.GatewayMessage) -> None:
        kind = msg.WhichOneof("body")
        engine = self.engine
        if kind == "drain":
            log.info("draining", worker_id=engine.worker_id)
            engine.drain()
        elif kind == "drop_checkpoint":
            engine.ckpt.drop(list(msg.drop_checkpoint.rids))
        elif kind == "assign_holder":
            a = msg.assign_holder
            resent = engine.assign_holders(a.rid, [h.kv_endpoint for h in a.holders])
            log.info("holders assigned", rid=a.rid, holders=[h.worker_id for h in a.holders], resent=resent)
        elif kind == "start_draft_assist":
            s = msg.start_draft_assist
            engine.assist.start_pair(s.peer_id, s.peer_endpoint, s.role, s.k, s.peer_plane_key)
        elif kind == "members":
            # who may speak on this worker's data planes, and their keys (gateway/protocol/planes.py);
            # with several gateways, the union of what each says (this role is one gateway's session)
            engine.planes.members.apply(msg.members, source=self)
            log.debug("plane members", worker_id=engine.worker_id, members=len(msg.members.members))
        elif kind == "reload_from":
            r = msg.reload_from
            if not engine.seeding.seed_from(r.seed_worker_id, r.seed_url):
                log.info("reload seed ignored", worker_id=engine.worker_id, seed=r.seed_worker_id)
        elif kind == "stop_draft_assist":
            engine.assist.stop_pair(msg.stop_draft_assist.peer_id)
        elif kind == "set_admission":
            a = msg.set_admission
            rate = a.shortest_first_rate if a.shortest_first else None
            limit = engine.set_admission(self.source, a.batch_boost, a.lease_s, rate)
            log.debug("admission", worker_id=engine.worker_id, boost=a.batch_boost, max_running=limit)
        else:
            log.info("unknown command ignored", worker_id=engine.worker_id, command=kind)

    async def reset(self) -> None:
        self.engine.reset_incarnation()
        for other in self.siblings:
            other.end_session("the worker became a new incarnation (fenced by another gateway)", reset=False)


class Agent(ControlClient):
    """The control-plane client of one Lumen worker: `Agent(spec, engine, url)`."""

    def __init__(
        self,
        spec: EngineSpec,
        engine: Engine,
        http_url: str,
        *,
        backoff_start_s: float = BACKOFF_START_S,
        backoff_cap_s: float = BACKOFF_CAP_S,
        welcome_timeout_s: float = WELCOME_TIMEOUT_S,
        address: str | None = None,
    ) -> None:
        """`address`: the gateway to attach to (default: spec.control_address); a worker of a cluster
        with several gateways runs one Agent per gateway, all over the same engine."""
        self.spec = spec
        self.engine = engine
        self.http_url = http_url
        self.engine_role = EngineRole(spec, engine, http_url)
        self.engine_role.source = address if address is not None else spec.control_address
        super().__init__(
            self.engine_role,
            address if address is not None else spec.control_address,
            token=spec.control_token,
            tls_ca=spec.control_tls_ca,
            heartbeat_interval_ms=spec.heartbeat_interval_ms,
            backoff_start_s=backoff_start_s,
            backoff_cap_s=backoff_cap_s,
            welcome_timeout_s=welcome_timeout_s,
        )
