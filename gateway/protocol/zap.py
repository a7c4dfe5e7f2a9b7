"""The ZAP side of the data planes' CURVE security (gateway/protocol/planes.py says how it fits):
the handler that admits only current members' keys (`ZapGuard`), the watch that counts and logs
failed handshakes on a server socket (`HandshakeWatch`), and the client-side reconnect after a
refused handshake, which libzmq never retries itself (`RetryRefused`)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Protocol

import structlog
import zmq
import zmq.asyncio
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from gateway.protocol.planes import PlaneSecurityError, RefusalLog

log = structlog.get_logger("lumen.planes")
ZAP_ENDPOINT: Final = "inproc://zeromq.zap.01"  # where libzmq asks (RFC 27); one handler per context
# how long a handshake with a key the table does not know yet waits for a Members update
KEY_WAIT_S: Final = 2.0
MAX_WAITING_HANDSHAKES: Final = 256  # beyond: refused at once (no memory for a flood of strangers)
KEY_POLL_S: Final = 0.01

# -- failed handshakes on a server socket --------------------------------------------------------
# a peer without CURVE (mechanism mismatch), with another server key, or refused by ZAP
HANDSHAKE_FAILURES: Final = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
# what a server counts: also a peer that hung up mid-handshake. A plaintext client that sees the
# server's CURVE greeting first may close before the server has read its own: the server then sees no
# mechanism mismatch, only this (under load, every time)
SERVER_HANDSHAKE_FAILURES: Final = HANDSHAKE_FAILURES | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


MONITOR_POLL_MS: Final = 250


async def _monitor_events(mon: zmq.asyncio.Socket) -> AsyncIterator[dict[str, Any]]:
    """The events of a ZMQ socket monitor. The monitor is read without blocking after each wake-up
    *and* every MONITOR_POLL_MS: a lone event can fail to wake an asyncio reader (zmq's edge-triggered
    notifications), and one lost event would mean a refused handshake never counted or retried."""
    while True:
        with contextlib.suppress(zmq.Again):
            await mon.poll(MONITOR_POLL_MS)
        while True:
            try:
                frames = await mon.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                ev = dict(parse_monitor_message(frames))
            except (ValueError, KeyError):
                continue
            yield ev


class HandshakeWatch:
    """Counts and logs the failed handshakes on one CURVE server socket (its monitor), on its loop:
    what a plaintext attacker's connection amounts to, since nothing of it reaches the application."""

    def __init__(self, sock: zmq.asyncio.Socket, plane: str) -> None:
        self.failed = 0
        self._sock = sock
        self._log = RefusalLog(f"{plane}_handshake_failed")
        # every event, filtered here: with a mask of only the failures libzmq was seen to deliver none
        self._mon: zmq.asyncio.Socket | None = sock.get_monitor_socket(zmq.EVENT_ALL)
        self._task: asyncio.Task[None] | None = asyncio.get_running_loop().create_task(
            self._run(), name=f"lumen-{plane}-handshakes"
        )

    async def _run(self) -> None:
        mon = self._mon
        assert mon is not None
        with contextlib.suppress(zmq.ZMQError):
            async for ev in _monitor_events(mon):
                if ev.get("event", 0) & SERVER_HANDSHAKE_FAILURES:
                    self._failed(ev)

    def _failed(self, ev: dict[str, Any]) -> None:
        self.failed += 1
        event, value = ev.get("event"), ev.get("value")
        self._log(
            getattr(event, "name", str(event)),
            None,
            detail=getattr(value, "name", str(value)),
            endpoint=str(ev.get("endpoint", b""), "ascii", "replace"),
        )

    async def close(self) -> None:
        """Stop watching; call before the socket closes."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._mon is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
            self._mon.close(0)
            self._mon = None


class RetryRefused:
    """A CURVE client socket's second chance: libzmq never retries a connection whose handshake was
    refused (the server's ZAP said no, e.g. because its Members update naming this client was still on
    its way; or another server key). This watches the socket's handshakes and reconnects `endpoint`
    after each failure, backing off from `first_s` to `max_s`; a success resets the backoff."""

    def __init__(self, sock: zmq.asyncio.Socket, endpoint: str, *, first_s: float = 0.2, max_s: float = 5.0):
        self.sock, self.endpoint = sock, endpoint
        self.first_s, self.max_s = first_s, max_s
        self.retries = 0
        self._mon: zmq.asyncio.Socket | None = sock.get_monitor_socket(zmq.EVENT_ALL)  # filtered below
        self._task: asyncio.Task[None] | None = asyncio.get_running_loop().create_task(
            self._run(), name=f"lumen-plane-retry {endpoint}"
        )

    async def _run(self) -> None:
        mon = self._mon
        assert mon is not None
        backoff = self.first_s
        with contextlib.suppress(zmq.ZMQError):
            async for ev in _monitor_events(mon):
                event = ev.get("event", 0)
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    backoff = self.first_s
                if not event & HANDSHAKE_FAILURES:
                    continue
                await asyncio.sleep(backoff)
                backoff = min(self.max_s, 2 * backoff)
                self.retries += 1
                with contextlib.suppress(zmq.ZMQError):
                    self.sock.disconnect(self.endpoint)
                with contextlib.suppress(zmq.ZMQError):
                    self.sock.connect(self.endpoint)

    def stop(self) -> None:
        """Stop now (from sync code); call before the socket closes."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
        if self._mon is not None:
            with contextlib.suppress(zmq.ZMQError):
                self.sock.disable_monitor()
            self._mon.close(0)
            self._mon = None

    async def close(self) -> None:
        """Stop, and wait for the watch to end; call before the socket closes."""
        task = self._task
        self.stop()
        if task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task


# -- the ZAP handler ------------------------------------------------------------------------------
class KeyPolicy(Protocol):
    def __call__(self, key: str) -> bool: ...


@dataclass(slots=True)
class ZapStats:
    allowed: int = 0
    refused: int = 0
    waited: int = 0  # handshakes held for a Members update


class ZapGuard:
    """The ZAP handler (RFC 27) of one ZMQ context, on its event loop: a CURVE handshake in domain d is
    allowed when `policies[d](client key)`; an unknown key is held up to `wait_s` (re-checked every
    `KEY_POLL_S`), then refused. Anything but CURVE is refused. Shared by the plane servers of its
    context (`acquire`/`release`)."""

    _registry: ClassVar[dict[int, ZapGuard]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()
    # the `wait_s` of the guards `acquire` starts (tests shorten it; a guard keeps the one it began with)
    default_wait_s: ClassVar[float] = KEY_WAIT_S

    def __init__(self, ctx: zmq.asyncio.Context, *, wait_s: float | None = None) -> None:
        self.ctx = ctx
        self.wait_s = self.default_wait_s if wait_s is None else wait_s
        self.policies: dict[str, KeyPolicy] = {}
        self.stats = ZapStats()
        self.refusals = RefusalLog("plane_handshake_refused")
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._waiting: set[asyncio.Task[None]] = set()

    @classmethod
    def acquire(cls, ctx: zmq.asyncio.Context, domain: str, policy: KeyPolicy) -> ZapGuard:
        """The context's guard (started here on first use), now also deciding `domain`."""
        with cls._registry_lock:
            guard = cls._registry.get(id(ctx))
            if guard is None or guard.ctx is not ctx:
                guard = cls(ctx)
                guard._start()
                cls._registry[id(ctx)] = guard
            if domain in guard.policies:
                raise PlaneSecurityError(f"ZAP domain {domain!r} already has a policy in this context")
            guard.policies[domain] = policy
            return guard

    def release(self, domain: str) -> None:
        """`domain`'s server closed; the last one stops the guard."""
        with self._registry_lock:
            self.policies.pop(domain, None)
            if self.policies:
                return
            if self._registry.get(id(self.ctx)) is self:
                del self._registry[id(self.ctx)]
        self._stop()

    def _start(self) -> None:
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError as exc:
            sock.close(0)
            raise PlaneSecurityError(f"cannot install the ZAP handler: {exc}") from exc
        self._sock = sock
        self._task = asyncio.get_running_loop().create_task(self._run(), name="lumen-zap")

    def _stop(self) -> None:
        for t in [self._task, *self._waiting]:
            if t is not None:
                t.cancel()
        self._task = None
        self._waiting.clear()
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    async def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        while True:
            try:
                frames = await sock.recv_multipart()
            except zmq.Again:  # pyzmq saw POLLIN, the request was gone by the recv: wait again
                continue
            try:
                await self._request(sock, frames)
            except Exception:  # the outermost loop: a malformed request must not stop the guard
                log.exception("zap_request_failed", frames=len(frames))

    async def _request(self, sock: zmq.asyncio.Socket, frames: list[bytes]) -> None:
        # [routing id, b"", version, request id, domain, address, identity, mechanism, credentials...]
        if len(frames) < 8 or frames[1] != b"":
            return
        route, request_id = frames[0], frames[3]
        domain, mechanism, creds = frames[4].decode("ascii", "replace"), frames[7], frames[8:]
        policy = self.policies.get(domain)
        if policy is None or mechanism != b"CURVE" or len(creds) != 1 or len(creds[0]) != 32:
            await self._answer(sock, route, request_id, None, f"{mechanism!r} in domain {domain!r}")
            return
        key = z85.encode(creds[0]).decode("ascii")
        if policy(key):
            await self._answer(sock, route, request_id, key, "")
        elif self.wait_s > 0 and len(self._waiting) < MAX_WAITING_HANDSHAKES:
            self.stats.waited += 1
            task = asyncio.get_running_loop().create_task(self._wait(sock, route, request_id, key, policy))
            self._waiting.add(task)
            task.add_done_callback(self._waiting.discard)
        else:
            await self._answer(sock, route, request_id, None, "not a member", key)

    async def _wait(
        self, sock: zmq.asyncio.Socket, route: bytes, request_id: bytes, key: str, policy: KeyPolicy
    ) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        while loop.time() < deadline:
            await asyncio.sleep(KEY_POLL_S)
            if policy(key):
                await self._answer(sock, route, request_id, key, "")
                return
        await self._answer(sock, route, request_id, None, "not a member", key)

    async def _answer(
        self,
        sock: zmq.asyncio.Socket,
        route: bytes,
        request_id: bytes,
        key: str | None,
        why: str,
        peer: str = "",
    ) -> None:
        if self._sock is not sock:
            return  # stopped meanwhile
        if key is not None:
            self.stats.allowed += 1
            reply = [route, b"", b"1.0", request_id, b"200", b"OK", key.encode("ascii"), b""]
        else:
            self.stats.refused += 1
            self.refusals(why, peer or None)
            reply = [route, b"", b"1.0", request_id, b"400", why.encode()[:255], b"", b""]
        with contextlib.suppress(zmq.ZMQError):
            await sock.send_multipart(reply)  # a ROUTER never blocks a send
