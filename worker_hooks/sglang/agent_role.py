"""One gateway's control session with an SGLang server (`SGLangRole`, an `AgentRole` of
`worker_hooks.control.ControlClient`): what differs from Lumen's engine. The truth it reports comes from
the `Sidecar` (agent.py), shared by every gateway's session.

- Hello says `engine = "sglang"` and `http_url = url` (the gateway then speaks SGLang's own `/generate`
  to it), the server's pid when the agent launched it, and its capacity from the last `/v1/loads`;
  the incarnation is time-based (microseconds) and strictly increasing across the agent's restarts;
  with a draft model, the endpoint of the agent's drafter (agent_draft.py);
- Hello's `plane_key` is the server's CURVE key, which the agent holds (plane_file.py); the gateways'
  `Members` go into the server's plane file;
- heartbeats carry the server's load: running, waiting and KV tokens used, summed over DP ranks, from
  the sidecar's last `/v1/loads` answer; the phase is LOADING_FULL until `/ready` answers 200, then
  SERVING (DRAINING once the gateway says Drain); a relaunch with a draft model is LOADING_DRAFT, then
  DRAFT_READY (the agent drafts for the survivor the gateway pairs it with) until the server serves;
- with Lumen's storage backend in the server, heartbeats also report its holder stores as Lumen's own
  workers report theirs: bytes used, tokens held, and the durable tokens of each request held (those
  that changed since the previous beat, all of them in a session's first beat);
- a relaunch's reload (agent_reload.py) is reported once, with the first SERVING heartbeat after it;
- when the gateway fences the session (ends the stream), the role asks the server to abort what it
  runs and re-attaches as a new incarnation. With several gateways it does not abort: SGLang aborts by
  rid prefix or all at once, the agent cannot tell one gateway's requests from another's, and the
  fencing gateway has already dropped its streams and aborts its own rids (gateway/server/sessions.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import structlog

from gateway.protocol import control_pb2 as pb
from gateway.protocol.generate import EngineKind
from worker_hooks.sglang.holder_report import DurableReporter

if TYPE_CHECKING:
    from worker_hooks.sglang.agent import Sidecar

log = structlog.get_logger(__name__)


def now_us() -> int:
    return time.time_ns() // 1000


class SGLangRole:
    """One gateway's session with the server (an `AgentRole`); the truth comes from the Sidecar."""

    def __init__(self, sidecar: Sidecar) -> None:
        self.sidecar = sidecar
        self._incarnation = now_us()
        self.draining = False
        self.reload_reported = 0  # the seq of the last Reload this gateway was told of
        self.durable = DurableReporter()  # what this gateway was told of the holder stores

    @property
    def worker_id(self) -> str:
        return self.sidecar.cfg.worker_id

    @property
    def incarnation(self) -> int:
        return self._incarnation

    def phase(self) -> pb.Phase:
        if not self.sidecar.up:
            drafter = self.sidecar.drafter
            draft_phase = drafter.phase() if drafter is not None else None
            return draft_phase if draft_phase is not None else pb.LOADING_FULL
        return pb.DRAINING if self.draining else pb.SERVING

    def hello(self) -> pb.Hello:
        s, cfg = self.sidecar, self.sidecar.cfg
        ranks = s.loads.loads if s.loads is not None else []
        return pb.Hello(
            worker_id=cfg.worker_id,
            model=cfg.model,
            http_url=cfg.url,
            engine=EngineKind.SGLANG,
            phase=self.phase(),
            pid=s.server_pid or 0,
            kv_capacity_tokens=sum(r.max_total_num_tokens for r in ranks),
            max_running_requests=sum(r.max_running_requests for r in ranks),
            failure_domain=cfg.failure_domain,
            tp=cfg.tp,
            awaiting_seed=s.reloader.awaiting_seed,
            kv_endpoint=cfg.kv_endpoint,
            plane_key=s.planes.keys.public,
            ckpt_budget_bytes=cfg.ckpt_budget_bytes,
            page_size=cfg.page_size,
            # each gateway holds its share: together they keep the server to its batch
            held_batch=max(1, cfg.held_batch // len(cfg.gateways)) if cfg.held_batch else 0,
            api_key=cfg.api_key,  # the gateways send it on their requests to the server
            # the drafter of a relaunch (agent_draft.py), bound for the agent's life
            draft_endpoint=s.drafter.endpoint if s.drafter is not None else "",
            draft_model=cfg.draft_model if s.drafter is not None else "",
        )

    def heartbeat(self, seq: int, *, full: bool) -> pb.Heartbeat:
        ranks = self.sidecar.loads.loads if self.sidecar.loads is not None else []
        phase = self.phase()
        beat = pb.Heartbeat(
            seq=seq,
            phase=phase,
            running=sum(r.num_running_reqs for r in ranks),
            waiting=sum(r.num_waiting_reqs for r in ranks),
            kv_tokens_used=sum(r.num_used_tokens for r in ranks),
            awaiting_seed=self.sidecar.reloader.awaiting_seed,
            pid=self.sidecar.server_pid or 0,  # a server relaunched within this session has a new one
            # what the server admits (its Hello may have gone before the first /v1/loads answered)
            batch_limit=sum(r.max_running_requests for r in ranks),
        )
        held = self.sidecar.holder
        if held is not None:
            beat.ckpt_bytes_used = held.bytes_used
            beat.ckpt_tokens_held = held.tokens_held
        if self.sidecar.holders is not None:
            beat.durable.extend(
                pb.DurableTokens(rid=r, tokens=t) for r, t in self.durable.beat(held, full=full).items()
            )
        reload = self.sidecar.reloader.reload
        if phase != pb.LOADING_FULL and reload is not None and reload.seq > self.reload_reported:
            self.reload_reported = reload.seq  # once, with the first serving beat after it
            beat.reload_seconds = reload.seconds
            beat.reload_source = reload.source.value
            beat.reload_seed = reload.seed
        return beat

    def welcomed(self, welcome: pb.Welcome) -> None:
        """The server's relaunch plan is the agent's (agent_reload); a Welcome only says whether its
        drafter should draft for this relaunch (`skip_draft`: the gateway's assist gate)."""
        if welcome.skip_draft and self.sidecar.drafter is not None:
            self.sidecar.drafter.skip()

    def command(self, msg: pb.GatewayMessage) -> None:
        kind = msg.WhichOneof("body")
        if kind == "drain":
            log.info("draining", worker_id=self.worker_id)
            self.draining = True
        elif kind == "members":
            self.sidecar.planes.update(self, msg.members)  # the server's plane file follows
        elif kind == "reload_from":
            self.sidecar.reloader.offer_seed(msg.reload_from.seed_worker_id, msg.reload_from.seed_url)
        elif self.sidecar.drafter is not None and self.sidecar.drafter.command(msg):
            pass  # draft assist: the relaunch's drafter was paired or unpaired
        else:
            # holder assignment needs Lumen's engine, an SGLang target's assist is the gateway's
            # (gateway-level verification); a DropCheckpoint for the server's
            # holder stores is not forwarded (the writer's END or the stores' orphan TTL frees the pages)
            log.info("command ignored: not for an SGLang server", worker_id=self.worker_id, command=kind)

    async def reset(self) -> None:
        s = self.sidecar
        if s.up and len(s.clients) == 1:
            await s.abort_all()
        self._incarnation = max(now_us(), self._incarnation + 1)
        self.draining = False
        s.emit("incarnation", incarnation=self._incarnation)
