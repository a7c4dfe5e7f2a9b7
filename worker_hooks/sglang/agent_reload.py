"""Seeded reload of a server the agent launched (`Reloader`): which command relaunches it, and how long
the reload took and where its weights came from.

When the server dies, the re-attaching sessions say `awaiting_seed` in their Hello and heartbeats and
the agent waits up to `seed_wait_s` (from the exit) for a gateway's `ReloadFrom{seed}`, a running server
of the same model and TP picked by that gateway. It then launches the server with SGLang's
`--load-format remote_instance` flags naming the seed (launcher.seeded_command; weight-transfer group
ports `weights_group_ports`, by default derived from the server's own port), or from storage when no
seed came. Only a server that was serving is seeded; one that died while loading is relaunched from
storage at once. A seeded server that exits before `/ready` answers 200, or is not ready within
`seed_timeout_s` (then the agent kills it), is launched again at once from storage. The reload is
measured from the server's exit to the first 200 from `/ready`, with its source (`peer` or `disk`), and
reported once to each gateway with the first SERVING heartbeat after it (`reload_seconds`,
`reload_source`, `reload_seed`; agent_role.py); the first launch is not a reload.

Never where it cannot work: SGLang's remote_instance loader takes only CUDA and NPU devices
(`RemoteInstanceConnector`, srt/connector/remote_instance.py: "RemoteInstanceConnector only supports cuda
device."), so a server launched with another `--device` (cpu) is never seeded (`seed_refusal`): its
relaunches never say `awaiting_seed`, wait for no seed and load from storage at once, and a ReloadFrom
that comes anyway is ignored. A seeded launch there failed in its loader, but only after asking the seed
to set up the transfer group, which left the seed's scheduler waiting for a peer that never came
(plugin_seed.py now time-boxes that wait in every server Lumen launched).

The `Sidecar` (agent.py) calls `started`, `exited` and `ready` as the server's process and `/ready` say
so; `next_command` is the launcher's `ServerProcess.next_command`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

import structlog

from worker_hooks.sglang.agent_config import SidecarConfig
from worker_hooks.sglang.launcher import LaunchError, ServerExit, device_of, seeded_command

log = structlog.get_logger(__name__)


# the devices SGLang's remote_instance loader takes (srt/connector/remote_instance.py)
SEEDED_DEVICES = frozenset({"cuda", "npu"})


def seed_refusal(launch: list[str] | None) -> str:
    """Why a server launched with `launch` can never load its weights from a seed ("": it can)."""
    if launch is None:
        return ""
    device = device_of(launch)
    if device.split(":", 1)[0] not in SEEDED_DEVICES:
        return (
            f"--device {device}: SGLang's remote_instance loader takes only {' and '.join(sorted(SEEDED_DEVICES))} "
            "(srt/connector/remote_instance.py)"
        )
    return ""


class Emit(Protocol):
    """Records one of the agent's events (`Sidecar.emit`)."""

    def __call__(self, event: str, **fields: Any) -> None: ...


class Source(StrEnum):
    """Where a relaunched server's weights came from."""

    PEER = "peer"  # a running server (the seed), over SGLang's remote_instance loader
    DISK = "disk"  # its own storage


@dataclass(frozen=True, slots=True)
class Reload:
    """One relaunch, from the server's exit to the first 200 from /ready."""

    seq: int  # 1, 2, ... per agent
    seconds: float
    source: Source
    seed: str  # the seed's worker id (peer), the seed that failed (disk), or ""


@dataclass(slots=True)
class Attempt:
    """One launch of the server: seeded (`seed` set) or from storage."""

    seed: str = ""
    seed_url: str = ""
    pid: int | None = None
    ready: bool = False


class Reloader:
    """The launches of one server: seeded or from storage, and the last reload."""

    def __init__(
        self,
        cfg: SidecarConfig,
        launch: list[str] | None,
        *,
        seeding: bool,
        emit: Emit,
        kill: Callable[[], None],
    ) -> None:
        """`launch`: the command loading from storage (None: the agent does not launch the server);
        `seeding`: relaunches may be seeded; `kill`: kill the running server."""
        self.cfg = cfg
        self.launch = launch
        # never where SGLang's loader cannot take a seed: relaunches then load from storage at once
        self.seed_refused = seed_refusal(launch) if seeding else ""
        self.seeding = seeding and not self.seed_refused
        if self.seed_refused:
            log.info("seeded reload off", worker_id=cfg.worker_id, reason=self.seed_refused)
        self._emit = emit
        self._kill = kill
        self.awaiting_seed = False  # between the server's exit and its relaunch, when it may be seeded
        self.attempt = Attempt()  # the launch running now
        self.reload: Reload | None = None  # the last one
        self.reloads = 0
        self._seed_offer: asyncio.Future[tuple[str, str]] | None = None
        self._down_since: float | None = None  # time.monotonic() of the exit being reloaded from
        self._last_exit_at = 0.0
        self._failed_seed = ""  # a seed whose launch failed during the current reload
        self._disk_next = False  # the seeded launch failed: the next one loads from storage
        self._seed_timer: asyncio.Task[None] | None = None

    def take_timer(self) -> asyncio.Task[None] | None:
        """The seed timer running now, if any, handed over to be cancelled (the agent is stopping)."""
        timer, self._seed_timer = self._seed_timer, None
        return timer

    # -- what the server does -------------------------------------------------------------------
    def started(self, pid: int) -> None:
        self.attempt.pid = pid
        self._emit(
            "server_started", pid=pid, source=(Source.PEER if self.attempt.seed else Source.DISK).value
        )
        if self.attempt.seed:
            self._seed_timer = asyncio.create_task(
                self._seed_deadline(self.attempt), name="sglang-seed-timer"
            )

    def exited(self, ex: ServerExit) -> None:
        """The server exited: whether its relaunch waits for a seed (before the sessions end)."""
        self._last_exit_at = ex.at
        if self._down_since is None:
            self._down_since = ex.at  # what a relaunch is measured from
        attempt = self.attempt
        if attempt.seed and not attempt.ready:
            # the seed or the transfer failed: the next launch loads from storage, without waiting
            self._failed_seed, self._disk_next = attempt.seed, True
            self._emit("seed_failed", seed=attempt.seed, pid=ex.pid, returncode=ex.returncode)
            log.warning(
                "seeded server exited before ready; loading from storage",
                worker_id=self.cfg.worker_id,
                seed=attempt.seed,
                returncode=ex.returncode,
            )
        # before the sessions end (when the exit, not a refused poll, is the first news): their next
        # Hello says that this relaunch may be seeded, and so does every heartbeat until it launches.
        # Only a server that was serving is seeded; one that died while loading is relaunched from
        # storage at once.
        self.awaiting_seed = self.seeding and attempt.ready and not self._disk_next
        if self.awaiting_seed:
            self._seed_offer = asyncio.get_running_loop().create_future()

    def ready(self) -> None:
        """The first 200 from /ready of this launch: a relaunch's reload is complete."""
        self.attempt.ready = True
        if self._seed_timer is not None:
            self._seed_timer.cancel()
            self._seed_timer = None
        if self._down_since is None:
            return  # the first launch, or a server the agent does not run
        source = Source.PEER if self.attempt.seed else Source.DISK
        self.reloads += 1
        self.reload = Reload(
            seq=self.reloads,
            seconds=time.monotonic() - self._down_since,
            source=source,
            seed=self.attempt.seed or self._failed_seed,
        )
        self._down_since, self._failed_seed, self._disk_next = None, "", False
        self._emit(
            "reloaded", seconds=round(self.reload.seconds, 4), source=source.value, seed=self.reload.seed
        )
        log.info(
            "server reloaded",
            worker_id=self.cfg.worker_id,
            seconds=round(self.reload.seconds, 3),
            source=source.value,
            seed=self.reload.seed,
        )

    # -- seeds ----------------------------------------------------------------------------------
    def offer_seed(self, seed_worker_id: str, seed_url: str) -> None:
        """A gateway's ReloadFrom: taken when the agent waits for one, else ignored (the first wins)."""
        offer = self._seed_offer
        if not self.awaiting_seed or offer is None or offer.done():
            log.info(
                "ReloadFrom ignored: not waiting for a seed",
                worker_id=self.cfg.worker_id,
                seed=seed_worker_id,
            )
            return
        offer.set_result((seed_worker_id, seed_url))

    async def next_command(self) -> list[str]:
        """The command of the next relaunch (ServerProcess.next_command): seeded when a gateway named a
        seed within `seed_wait_s` of the exit, else from storage."""
        assert self.launch is not None
        self.attempt = Attempt()
        offer = self._seed_offer
        if not self.awaiting_seed or offer is None:
            self._disk_next = False
            return self.launch
        wait_s = self._last_exit_at + self.cfg.seed_wait_s - time.monotonic()
        try:
            async with asyncio.timeout(max(0.0, wait_s)):
                seed, seed_url = await offer
        except TimeoutError:
            self._emit("no_seed", waited_s=round(max(0.0, wait_s), 3))
            return self.launch
        finally:
            self.awaiting_seed = False
            self._seed_offer = None
        try:
            command = seeded_command(self.launch, seed_url, self.cfg.group_ports(), self.cfg.tp)
        except LaunchError as exc:
            log.warning("cannot seed from the gateway's choice", worker_id=self.cfg.worker_id, error=str(exc))
            self._emit("seed_refused", seed=seed, seed_url=seed_url, error=str(exc))
            return self.launch
        self.attempt = Attempt(seed=seed, seed_url=seed_url)
        self._emit("reload_from", seed=seed, seed_url=seed_url, group_ports=self.cfg.group_ports())
        return command

    async def _seed_deadline(self, attempt: Attempt) -> None:
        """Kill a seeded server that is not ready within seed_timeout_s (it then loads from storage)."""
        await asyncio.sleep(self.cfg.seed_timeout_s)
        if self.attempt is attempt and not attempt.ready:
            self._emit("seed_timeout", seed=attempt.seed, timeout_s=self.cfg.seed_timeout_s)
            log.warning(
                "seeded server not ready in time; killing it", worker_id=self.cfg.worker_id, seed=attempt.seed
            )
            self._kill()
