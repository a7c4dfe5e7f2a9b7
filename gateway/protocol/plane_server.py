"""The server socket of a data plane, set up in one place for both planes: the KV checkpoint plane's
store (worker_hooks/kv/receiver.py, `StoreServer`) and the draft plane's drafter
(draft_models/drafter.py, `DrafterServer`).

A `PlaneServer` binds its socket at its endpoint (tcp://127.0.0.1:0 picks a free port; `endpoint`
reports the bound one). With a `PlaneAuth` (gateway/protocol/planes.py says how the security fits) the
socket is a CURVE server whose context's ZAP handler admits only the plane's members, and the gateways
where the plane says so (`ZapGuard`, zap.py), and its failed handshakes are counted and logged
(`HandshakeWatch`); a message whose connection's key is no longer admitted is refused on arrival
(`_refuse_stranger`). It owns one task, the subclass's `_run`, started by `start()`; `close()` undoes
it all in the reverse order. `PLAINTEXT` (unit tests only) skips the security.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType
from typing import ClassVar, Protocol, Self

import zmq
import zmq.asyncio

from gateway.protocol.planes import PlaneAuth, RefusalLog, Security, curve_server
from gateway.protocol.zap import HandshakeWatch, ZapGuard


class RefusalCounts(Protocol):
    """What a plane server counts of the messages it refuses (its stats have more)."""

    messages: int
    refused: int
    unauthenticated: int  # the connection's key is not (or no longer) admitted


class PlaneServer:
    """One plane's server socket; subclasses set the class attributes and write `_run` and `_started`."""

    noun: ClassVar[str]  # what it is, in messages and its task's name: "KV store", "drafter"
    plane: ClassVar[str]  # "kv" | "draft": its handshake log's event is `<plane>_handshake_failed`
    domain: ClassVar[str]  # its ZAP domain (planes.KV_DOMAIN, DRAFT_DOMAIN)
    socket_type: ClassVar[int]  # zmq.PULL, zmq.ROUTER
    admits_gateways: ClassVar[bool]  # whether the gateways' keys may connect too, not only members'

    stats: RefusalCounts

    def __init__(
        self, endpoint: str, *, auth: Security, ctx: zmq.asyncio.Context | None, refusal_event: str
    ) -> None:
        self.auth = auth
        self.endpoint = ""
        self.refusals = RefusalLog(refusal_event)  # messages refused after the handshake
        self._bind_to = endpoint
        self._own_ctx = ctx is None
        self._ctx = ctx if ctx is not None else zmq.asyncio.Context()
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._guard: ZapGuard | None = None
        self._handshakes: HandshakeWatch | None = None

    # -- for subclasses ------------------------------------------------------------------------------
    def _configure(self, sock: zmq.asyncio.Socket) -> None:
        """Socket options of the plane's own, set before the socket binds."""

    def _started(self) -> None:
        """Called once the socket is bound and its task started (to log it)."""

    async def _run(self) -> None:
        raise NotImplementedError

    async def _stopping(self) -> None:
        """Called in `close()` once the task has ended, before the socket closes."""

    def admits(self, key: str) -> bool:
        """Whether a client with this CURVE key may connect (and its messages be handled) now."""
        auth = self.auth
        return isinstance(auth, PlaneAuth) and auth.members.allows(key, gateways=self.admits_gateways)

    def _refuse_stranger(self, key: str | None) -> None:
        """A message on a connection whose key is not (or no longer) admitted: counted and logged,
        nothing of it handled."""
        self.stats.messages += 1
        self.stats.refused += 1
        self.stats.unauthenticated += 1
        self.refusals("not a current member", key)

    # -- life ----------------------------------------------------------------------------------------
    async def start(self) -> str:
        if self._sock is not None:
            raise RuntimeError(f"{type(self).__name__} already started")
        sock = self._ctx.socket(self.socket_type)
        sock.setsockopt(zmq.LINGER, 0)
        self._configure(sock)
        auth = self.auth
        if isinstance(auth, PlaneAuth):
            curve_server(sock, auth, self.domain)
            self._guard = ZapGuard.acquire(self._ctx, self.domain, self.admits)
        try:
            sock.bind(self._bind_to)
        except zmq.ZMQError as exc:
            sock.close(0)
            self._release_guard()
            raise OSError(f"cannot bind {self.noun} at {self._bind_to}: {exc}") from exc
        self._sock = sock
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if isinstance(auth, PlaneAuth):
            self._handshakes = HandshakeWatch(sock, self.plane)
        task_name = f"{self.noun.lower().replace(' ', '-')} {self.endpoint}"
        self._task = asyncio.get_running_loop().create_task(self._run(), name=task_name)
        self._started()
        return self.endpoint

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._stopping()
        if self._handshakes is not None:
            await self._handshakes.close()
            self._handshakes = None
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        self._release_guard()
        if self._own_ctx and not self._ctx.closed:
            self._ctx.term()

    @property
    def handshakes_failed(self) -> int:
        """Connections whose CURVE handshake failed (no CURVE, wrong server key, not a member)."""
        return self._handshakes.failed if self._handshakes is not None else 0

    def _release_guard(self) -> None:
        if self._guard is not None:
            self._guard.release(self.domain)
            self._guard = None

    def _socket(self) -> zmq.asyncio.Socket:
        """The bound socket (for `_run`)."""
        if self._sock is None:
            raise RuntimeError(f"{type(self).__name__} not started")
        return self._sock

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
