"""A restarting worker's drafter role (DESIGN 1.3, 4.5): it drafts for a survivor while its full model
loads.

The drafter's ROUTER socket is bound when the engine starts, so the first Hello already carries its
`draft_endpoint` and no second Hello is needed; the draft model only proposes once it is loaded
(`ready()`, the worker's DRAFT_READY). Before that a round is answered with no drafts (the gateway
pairs no target with a worker that is still loading, so this only guards against an early peer).

Once the full model serves, the role retires: it keeps answering until the gateway has ended every
pair it was told about (StopDraftAssist) or `linger_s` has passed, then until no round has arrived
for `quiet_s` (so rounds in flight are answered), and then it closes its socket. A target that sends
after that sees its drafter gone and continues alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import structlog

from draft_models.draft_model import DraftModel, DraftState, Proposal
from draft_models.drafter import DrafterServer
from draft_models.synthetic_drafter import SyntheticDrafter
from gateway.core.costmodel import CostModel
from gateway.protocol.launch import EngineSpec
from gateway.protocol.planes import Security
from models.synthetic import Sampler

if TYPE_CHECKING:
    from draft_models.torch_drafter import TorchDrafter
    from models.torch_model import CausalLM

log = structlog.get_logger(__name__)

# how long a retiring drafter waits for the gateway to end its pairs, and for rounds to stop arriving
LINGER_S = 2.0
MAX_QUIET_WAIT_S = 1.0
QUIET_POLL_S = 0.005


class _LoadingGate:
    """The draft model behind a switch: contexts are tracked from the start, drafts only once loaded."""

    def __init__(self, model: DraftModel) -> None:
        self.model = model
        self.loaded = False

    def start(self, context: Sequence[int]) -> DraftState:
        return self.model.start(context)

    def sync(self, state: DraftState, tokens: Sequence[int]) -> None:
        self.model.sync(state, tokens)

    def propose(self, state: DraftState, k: int, sampler: Sampler, *, want_q: bool = False) -> Proposal:
        if not self.loaded:
            return Proposal((), () if want_q else None)
        return self.model.propose(state, k, sampler, want_q=want_q)


class DrafterRole:
    """A drafter on the draft plane: `model` proposes once `set_ready` (module docstring). Lumen's engine
    builds one from its launch spec (`for_spec`); the SGLang agent builds one over a real draft model
    (worker_hooks/sglang/agent_draft.py)."""

    def __init__(
        self,
        worker_id: str,
        model: DraftModel,
        *,
        auth: Security,
        host: str,
        draft_timeout_ms: float,
        cost: CostModel | None = None,
        time_scale: float = 0.0,
        torch_drafter: TorchDrafter | None = None,
        thread: ThreadPoolExecutor | None = None,
    ) -> None:
        """`torch_drafter`: `model` when it is one (its weights arrive with `set_model`); `thread`: where
        proposals run (a real model's forward passes, off the event loop); `cost` and `time_scale`: the
        modelled time of a synthetic draft model (0: none)."""
        self.worker_id = worker_id
        self.cost = cost
        self.torch_drafter = torch_drafter
        self._thread = thread
        self._gate = _LoadingGate(model)
        self._server = DrafterServer(
            self._gate,
            f"tcp://{host}:0",
            auth=auth,
            cost=cost,
            time_scale=time_scale,
            thread=thread,
        )
        self.quiet_s = max(0.02, draft_timeout_ms / 1000.0)
        self.endpoint = ""  # "" before start and after retirement
        self.peers: set[str] = set()  # targets the gateway paired us with
        self._unpaired = asyncio.Event()
        self._unpaired.set()

    @classmethod
    def for_spec(cls, spec: EngineSpec, worker_id: str, *, auth: Security) -> DrafterRole:
        """The drafter of a restarting Lumen worker: its launch spec's draft model (synthetic, or torch)."""
        cost = CostModel.preset(spec.draft_model, spec.gpu)
        if spec.backend == "torch":
            from draft_models.torch_drafter import TorchDrafter  # torch only where it is used

            # its model arrives with set_model; a real model takes real time, nothing is modelled
            drafter = TorchDrafter()
            return cls(
                worker_id,
                drafter,
                auth=auth,
                host=spec.host,
                draft_timeout_ms=spec.draft_timeout_ms,
                cost=cost,
                torch_drafter=drafter,
                thread=ThreadPoolExecutor(1, thread_name_prefix=f"drafter-{worker_id}"),
            )
        # the same model seed and token range as the target: agreeing drafts are the target's tokens
        synthetic = SyntheticDrafter(
            spec.draft_agreement,
            model_seed=spec.model_seed,
            token_lo=spec.token_lo,
            token_hi=spec.token_hi,
        )
        return cls(
            worker_id,
            synthetic,
            auth=auth,
            host=spec.host,
            draft_timeout_ms=spec.draft_timeout_ms,
            cost=cost,
            time_scale=spec.time_scale,
        )

    @property
    def ready(self) -> bool:
        return self._gate.loaded

    @property
    def drafted_total(self) -> int:
        return self._server.stats.drafted

    def plane_refusals(self) -> dict[str, int]:
        """What the drafter's plane refused so far, by reason (gateway/protocol/planes.py)."""
        return {
            "handshake": self._server.handshakes_failed,
            "unauthenticated": self._server.stats.unauthenticated,
        }

    async def start(self) -> None:
        self.endpoint = await self._server.start()

    def set_model(self, model: CausalLM | None) -> None:
        """The torch backend's draft model, once loaded (before `set_ready`)."""
        if self.torch_drafter is not None:
            self.torch_drafter.model = model

    def set_ready(self) -> None:
        """The draft model is loaded: answer rounds with drafts from now on."""
        self._gate.loaded = True
        log.info("drafter ready", worker_id=self.worker_id, endpoint=self.endpoint)

    # -- pairs (control plane) ------------------------------------------------------------------
    def paired(self, target: str, k: int) -> None:
        self.peers.add(target)
        self._unpaired.clear()
        log.info("drafting for", worker_id=self.worker_id, target=target, k=k, endpoint=self.endpoint)

    def unpaired(self, target: str) -> None:
        self.peers.discard(target)
        if not self.peers:
            self._unpaired.set()
        log.info("drafting ended", worker_id=self.worker_id, target=target)

    def forget_pairs(self) -> None:
        """A new incarnation: the gateway no longer knows the pairs of the old one."""
        self.peers.clear()
        self._unpaired.set()

    # -- retirement -----------------------------------------------------------------------------
    async def retire(self, linger_s: float = LINGER_S, *, close: bool = True) -> None:
        """The full model serves: finish the pairs and the rounds in flight, then close (or, with
        `close=False`, keep the socket and drop the draft model: a drafter that drafts again at the
        next restart, as the SGLang agent's)."""
        try:
            await asyncio.wait_for(self._unpaired.wait(), linger_s)
        except TimeoutError:
            log.warning(
                "drafter retiring with pairs open", worker_id=self.worker_id, peers=sorted(self.peers)
            )
        loop = asyncio.get_running_loop()
        give_up = loop.time() + MAX_QUIET_WAIT_S
        seen, quiet_since = self._server.stats.messages, loop.time()
        while loop.time() < give_up and loop.time() - quiet_since < self.quiet_s:
            await asyncio.sleep(QUIET_POLL_S)
            if self._server.stats.messages != seen:
                seen, quiet_since = self._server.stats.messages, loop.time()
        if close:
            await self.close()
        else:
            self.unload()
        log.info("drafter retired", worker_id=self.worker_id, drafted=self._server.stats.drafted)

    def unload(self) -> None:
        """Propose nothing from now on and let the draft model go (the socket stays bound)."""
        self._gate.loaded = False
        self.set_model(None)
        self.forget_pairs()

    async def close(self) -> None:
        await self._server.close()
        self.endpoint = ""
        if self._thread is not None:
            self._thread.shutdown(wait=False)
