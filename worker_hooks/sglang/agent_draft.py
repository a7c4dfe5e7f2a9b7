"""The agent's drafter (`RestartDrafter`): a relaunched SGLang server's draft model, drafting for a
survivor while the server loads (DESIGN 1.3, mechanism 3; docs/sglang.md "Draft assist").

SGLang runs drafters only inside the target's own process, so a restarting server cannot draft for
another. Its agent can: the agent outlives the server it launched, and with `--draft-model DIR` (a
Hugging Face folder of a small model sharing the target's tokenizer) it runs Lumen's drafter
(`worker_hooks.engine.drafting.DrafterRole` over `draft_models.torch_drafter.TorchDrafter`) on the
draft plane, under the server's plane keys (the gateways reach it with the server's `plane_key`, as
they reach Lumen's workers). The drafter's socket is bound once, when the agent starts, so every Hello
carries its `draft_endpoint`; the draft model is loaded only for a relaunch:

- the server is lost and the agent will relaunch it (`relaunching`, called before the sessions end, so
  the new incarnation's Hello says LOADING_DRAFT): the draft model loads in a thread; the sessions
  report LOADING_DRAFT, then DRAFT_READY once it is loaded, and the gateway pairs the worker with its
  most loaded survivor (StartDraftAssist) and verifies the drafts on that SGLang target itself
  (gateway-level verification, docs/sglang.md);
- a gateway's Welcome with `skip_draft` (its assist gate says drafting would not pay, or its mode has
  no draft assist) stops the load: the relaunch is reported as a plain one (LOADING_FULL);
- the server serves again (`served`): the pairs end (the gateway stops them when the worker leaves
  DRAFT_READY), rounds in flight are answered, and the draft model is dropped; the socket stays.

The first start is not a restart: the server loads with nothing to draft for (LOADING_FULL).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import structlog

from gateway.protocol import control_pb2 as pb
from gateway.protocol.planes import Security
from worker_hooks.engine.drafting import DrafterRole
from worker_hooks.sglang.agent_config import DRAFT_TIMEOUT_MS

log = structlog.get_logger(__name__)

Emit = Callable[..., None]


class RestartDrafter:
    """The draft model of a relaunch, on the draft plane (module docstring)."""

    def __init__(
        self,
        worker_id: str,
        model_dir: str,
        *,
        auth: Security,
        host: str,
        device: str = "cpu",
        draft_timeout_ms: float = DRAFT_TIMEOUT_MS,
        emit: Emit | None = None,
    ) -> None:
        from draft_models.torch_drafter import TorchDrafter  # torch only in an agent that drafts

        self.model_dir, self.device = model_dir, device
        self._torch = TorchDrafter()
        self.role = DrafterRole(
            worker_id,
            self._torch,
            auth=auth,
            host=host,
            draft_timeout_ms=draft_timeout_ms,
            torch_drafter=self._torch,
            thread=ThreadPoolExecutor(1, thread_name_prefix=f"drafter-{worker_id}"),
        )
        self._emit = emit if emit is not None else (lambda *a, **k: None)
        self.restarting = False  # a relaunch is loading: the phases are the draft's
        self.skipped = False  # a gateway said this relaunch loads the full model only
        self.failed = False  # the draft model of this relaunch could not load
        self._load: asyncio.Task[None] | None = None
        self._retire: asyncio.Task[None] | None = None

    @property
    def endpoint(self) -> str:
        return self.role.endpoint

    async def start(self) -> None:
        await self.role.start()

    async def close(self) -> None:
        for task in (self._load, self._retire):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.role.close()

    def phase(self) -> pb.Phase | None:
        """The sessions' phase while the server loads: None where the drafter has nothing to say."""
        if not self.restarting or self.skipped or self.failed:
            return None
        return pb.DRAFT_READY if self.role.ready else pb.LOADING_DRAFT

    # -- the relaunch ---------------------------------------------------------------------------
    def relaunching(self) -> None:
        """The server is lost and will be relaunched: load the draft model (unless it is loaded)."""
        if self._retire is not None:
            self._retire.cancel()
            self._retire = None
        self.restarting, self.skipped, self.failed = True, False, False
        if not self.role.ready and (self._load is None or self._load.done()):
            self._load = asyncio.get_running_loop().create_task(self._load_model(), name="draft-load")

    def skip(self) -> None:
        """A gateway's Welcome said skip_draft: this relaunch loads the full model only."""
        if not self.restarting or self.skipped:
            return
        self.skipped = True
        if self._load is not None:
            self._load.cancel()
        self.role.unload()
        self._emit("draft_skipped")

    def served(self) -> None:
        """The relaunched server serves: end the drafting (pairs, rounds in flight), drop the model."""
        if not self.restarting:
            return
        self.restarting = False
        if self._load is not None:
            self._load.cancel()
        if self.role.ready:
            self._retire = asyncio.get_running_loop().create_task(self._retire_role(), name="draft-retire")

    async def _load_model(self) -> None:
        from models.torch_weights import load_model

        t0 = time.monotonic()
        self._emit("draft_loading", model=self.model_dir)
        try:
            model = await asyncio.to_thread(load_model, self.model_dir, device=self.device)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a relaunch without drafting is still a relaunch
            self.failed = True
            log.error("draft model failed to load", model=self.model_dir, error=repr(exc)[:300])
            self._emit("draft_failed", error=repr(exc)[:300])
            return
        if not self.restarting or self.skipped:
            return
        self.role.set_model(model)
        self.role.set_ready()
        self._emit("draft_ready", seconds=round(time.monotonic() - t0, 3), endpoint=self.endpoint)

    async def _retire_role(self) -> None:
        await self.role.retire(close=False)
        self._emit("draft_retired", drafted=self.role.drafted_total)

    # -- the gateways' commands -----------------------------------------------------------------
    def command(self, msg: pb.GatewayMessage) -> bool:
        """StartDraftAssist / StopDraftAssist for the drafter; False for anything else."""
        kind = msg.WhichOneof("body")
        if kind == "start_draft_assist":
            start = msg.start_draft_assist
            if start.role != "drafter":  # an SGLang target is verified by the gateway, not here
                return False
            self.role.paired(start.peer_id, start.k)
            return True
        if kind == "stop_draft_assist":
            self.role.unpaired(msg.stop_draft_assist.peer_id)
            return True
        return False
