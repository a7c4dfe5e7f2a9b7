"""Seeded reload on Lumen's workers: the full weights from a running peer instead of storage (issue 14).

The simulator's `recovery.reload = "peer"` and Lumen's SGLang agent (`--load-format remote_instance`)
have it; this is the same timeline on Lumen's own workers, so a live cluster can measure it too.

- The restart's side (`SeededReload`): a restarting worker started with `reload_from_peer` says
  `awaiting_seed` in its Hello and heartbeats. The gateway's reload coordinator answers with
  `ReloadFrom{seed_worker_id, seed_url}` (the core's `choose_seed`: the least loaded HEALTHY worker of
  the same model and TP, one restart per seed), and the engine replaces its load plan with the peer
  plan (loading.py: the cost model's peer load time, or `peer_load_s`). With no answer it loads from
  storage as planned. The transfer is the last `peer_weights_s` of the load: then the worker holds a
  `POST /lumen/seed_send` open on its seed for the transfer's length; a seed that dies mid-way breaks
  it and the rest of the weights come from storage (`fallback_plan`: no second start-up, as the
  simulator models it). On SERVING the worker reports `reload_seconds` (modelled), `reload_source`
  (`peer`, `disk` or `peer>disk`) and `reload_seed` in a heartbeat to each gateway.
- The seed's side (`send`): while it sends, its steps take `CostModel.seed_slowdown()` times longer
  (the NIC reads its HBM), the cost the simulator charges the seed.

No weights move on the wire: the synthetic backend models every load, and the torch backend's models
are built from the same seed on every worker, so a peer load is the same load with the peer's time.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp
import structlog

from gateway.core.costmodel import ReloadSource
from gateway.core.health import Phase
from gateway.core.reload import SEED_LOST_SOURCE
from gateway.protocol.generate import SeedSend, encode
from gateway.protocol.secrets import worker_http_bearer
from worker_hooks.engine.loading import LoadPlan, fallback_plan, load_plan, peer_weights_s, plain_plan

if TYPE_CHECKING:
    from worker_hooks.engine.engine import Engine

log = structlog.get_logger(__name__)

# a transfer that outlasts its planned length by this much (wall) is taken as a lost seed
TRANSFER_GRACE_S = 5.0
_LOADING = (Phase.LOADING_DRAFT, Phase.DRAFT_READY, Phase.LOADING_FULL)


@dataclass(frozen=True, slots=True)
class ReloadReport:
    seconds: float  # modelled seconds from the restart's start until it served
    source: str  # "disk", "peer" or "peer>disk" (the seed was lost mid-way)
    seed: str  # the seed's worker id ("" from disk)


class SeededReload:
    """One engine's seeded reload: what it asks, what it was told, and how it went."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.awaiting = engine.spec.restart and engine.spec.reload_from_peer
        self.seed = ""
        self.source = ReloadSource.DISK.value
        self.report: ReloadReport | None = None
        self._task: asyncio.Task[None] | None = None
        self.sending = 0  # transfers this worker serves as a seed now
        self.sends_total = 0  # transfers it served to their end
        self._closed = asyncio.Event()  # the engine stops: a transfer in progress breaks

    @property
    def weights_source(self) -> ReloadSource:
        """Where the full weights come from now: the named seed, else storage."""
        return ReloadSource.PEER if self.source == ReloadSource.PEER else ReloadSource.DISK

    # -- the restart's side -----------------------------------------------------------------------
    def seed_from(self, seed_id: str, seed_url: str) -> bool:
        """The gateway named a seed: load the full weights from it. False when it comes too late
        (the worker no longer waits for one) or names nobody."""
        engine = self.engine
        if not self.awaiting or not seed_id or not seed_url or engine.phase not in _LOADING:
            return False
        self.awaiting = False
        self.seed, self.source = seed_id, ReloadSource.PEER.value
        if engine.phase is Phase.LOADING_DRAFT:  # the draft first only if it is still ahead (loading.py)
            plan = load_plan(engine.spec, engine.cost, ReloadSource.PEER)
        else:  # a plain restart (or a draft told to stop, or already drafting): as it is until it serves
            plan = LoadPlan(engine.phase, plain_plan(engine.spec, engine.cost, ReloadSource.PEER).changes)
        engine.replan(plan)
        scale = engine.spec.time_scale
        transfer = peer_weights_s(engine.spec, engine.cost) * scale
        self._task = asyncio.get_running_loop().create_task(
            self._transfer(seed_url, plan.serving_s - transfer, transfer), name=f"seed-{engine.worker_id}"
        )
        log.info("reload_seeded", worker_id=engine.worker_id, seed=seed_id, plan=plan)
        return True

    async def _transfer(self, seed_url: str, start_s: float, seconds: float) -> None:
        """At `start_s` into the load, hold the seed's send open for `seconds` (wall); on failure the
        rest of the weights come from storage."""
        engine = self.engine
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, engine.load_started + start_s - loop.time()))
        body = encode(SeedSend(seconds=seconds, slowdown=engine.cost.seed_slowdown()))
        headers = {"Content-Type": "application/json"}
        if engine.spec.control_token:
            headers["Authorization"] = f"Bearer {worker_http_bearer(engine.spec.control_token)}"
        timeout = aiohttp.ClientTimeout(total=seconds + TRANSFER_GRACE_S)
        try:
            async with (
                aiohttp.ClientSession(timeout=timeout) as http,
                http.post(seed_url + "/lumen/seed_send", data=body, headers=headers) as resp,
            ):
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            if engine.phase in _LOADING:
                self.source = SEED_LOST_SOURCE
                elapsed = loop.time() - engine.load_started
                engine.replan(fallback_plan(engine.spec, engine.cost, engine.phase, elapsed))
                log.warning("reload_seed_lost", worker_id=engine.worker_id, seed=self.seed, error=repr(exc))

    def served(self, wall_s: float) -> None:
        """The restart serves: what the heartbeats report."""
        self.awaiting = False
        scale = self.engine.spec.time_scale
        self.report = ReloadReport(wall_s / scale if scale > 0 else 0.0, self.source, self.seed)
        log.info(
            "reloaded",
            worker_id=self.engine.worker_id,
            seconds=round(self.report.seconds, 3),
            source=self.source,
            seed=self.seed or None,
        )

    async def close(self) -> None:
        self._closed.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # -- the seed's side ----------------------------------------------------------------------------
    async def send(self, seconds: float, slowdown: float) -> bool:
        """Serve one transfer: this worker's steps are `slowdown` x longer for `seconds` (wall).
        False when the engine stopped first (the transfer broke)."""
        steps = self.engine.steps
        self.sending += 1
        steps.send_slowdown = slowdown
        log.info(
            "seed_sending", worker_id=self.engine.worker_id, seconds=round(seconds, 3), slowdown=slowdown
        )
        try:
            await asyncio.wait_for(self._closed.wait(), seconds)
            return False
        except TimeoutError:
            self.sends_total += 1
            return True
        finally:
            self.sending -= 1
            if not self.sending:
                steps.send_slowdown = 1.0
