"""Security of the ZMQ data planes (KV checkpoints, DESIGN 4.4; draft assist, 4.5): CURVE keys, the
cluster's members, and the ZAP handler that admits only them.

Every process that speaks on a plane has one CURVE keypair (`CurveKeypair.generate()`, at start; the
secret never leaves the process, or, for an SGLang server, the 0600 plane file its agent wrote). A
worker announces the public half in its Hello (`plane_key`) over the authenticated control plane; it
is the server key of its `kv_endpoint` and `draft_endpoint` and the client key it presents to peers.
The gateway sends each worker `Members` (control.proto) whenever its members change: every live
incarnation (worker id, incarnation, plane key, endpoints) plus the gateway's own client key. A
worker keeps them in a `MemberTable`:

- its plane servers (CURVE_SERVER) admit a connection only when the client's key is a current
  member's (`ZapGuard`, the ZAP handler of the server's ZMQ context; a key the table does not know
  yet is held up to `KEY_WAIT_S` for a Members update to catch up, then refused; libzmq never retries
  a refused connection, so Lumen's clients do, with backoff: `RetryRefused`). The connection's User-Id
  is the client's key (Z85). Failed handshakes (a plaintext peer, a refused key) are counted and
  logged (`HandshakeWatch`).
- each received message is checked against the table again (`MemberTable.member(User-Id)`): the key
  must still be a current member's, and on the KV plane the header's `src_worker` and `incarnation`
  must be that member's. A fenced incarnation's connection stays open, but its frames no longer reach
  a store; a frame of an older epoch never does.
- its clients pin the server key of the endpoint they connect to (`MemberTable.server_key`), so pages
  and contexts go only to the member the gateway named, encrypted.

A Lumen worker's keypair lives as long as its process: a new incarnation of the same process (after a
fence) keeps it, and the members table then maps the key to the new incarnation, so frames carrying
the old one are refused as `stale_epoch`.

`Plaintext` is for unit tests that build a plane server or client directly; no production path takes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import stat
import threading
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Final, Protocol

import structlog
import zmq
import zmq.asyncio
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from gateway.protocol import control_pb2 as pb

log = structlog.get_logger("lumen.planes")

ZAP_ENDPOINT: Final = "inproc://zeromq.zap.01"  # where libzmq asks (RFC 27); one handler per context
KV_DOMAIN: Final = "lumen.kv"
DRAFT_DOMAIN: Final = "lumen.draft"
KEY_LEN: Final = 40  # a Z85 CURVE key: 32 bytes
# how long a handshake with a key the table does not know yet waits for a Members update
KEY_WAIT_S: Final = 2.0
MAX_WAITING_HANDSHAKES: Final = 256  # beyond: refused at once (no memory for a flood of strangers)
KEY_POLL_S: Final = 0.01
# an SGLang server's keys and members: a 0600 file its sidecar agent writes, named in its environment
PLANE_FILE_ENV: Final = "LUMEN_PLANE_FILE"
PLANE_FILE_VERSION: Final = 1
FILE_RECHECK_S: Final = 0.02  # a FileMemberTable looks at its file's mtime at most this often


class PlaneSecurityError(RuntimeError):
    """The data planes cannot be secured here: no CURVE in libzmq, a bad key, a bad plane file."""


def require_curve() -> None:
    if not zmq.has("curve"):
        raise PlaneSecurityError(
            f"libzmq {zmq.zmq_version()} has no CURVE support; Lumen's data planes need it "
            "(pyzmq's wheels bundle libsodium)"
        )


def is_key(value: str) -> bool:
    """Whether `value` is a Z85-encoded 32-byte CURVE key."""
    if len(value) != KEY_LEN:
        return False
    try:
        return len(z85.decode(value)) == 32
    except (ValueError, KeyError, TypeError):
        return False


@dataclass(frozen=True, slots=True)
class CurveKeypair:
    public: str  # Z85
    secret: str = field(repr=False)  # Z85; never logged, never sent

    @classmethod
    def generate(cls) -> CurveKeypair:
        require_curve()
        public, secret = zmq.curve_keypair()
        return cls(public.decode("ascii"), secret.decode("ascii"))

    def __post_init__(self) -> None:
        if not (is_key(self.public) and is_key(self.secret)):
            raise PlaneSecurityError("a CURVE keypair needs two Z85 keys of 40 characters")


@dataclass(frozen=True, slots=True)
class Member:
    """A worker incarnation that may speak on the planes, under its key."""

    worker_id: str
    incarnation: int
    key: str
    kv_endpoint: str = ""
    draft_endpoint: str = ""


@dataclass(frozen=True, slots=True)
class _Snapshot:
    by_key: Mapping[str, Member]
    by_endpoint: Mapping[str, str]  # kv or draft endpoint -> the member's key
    by_worker: Mapping[str, Member]
    gateways: frozenset[str]


_EMPTY = _Snapshot({}, {}, {}, frozenset())
MAX_SHARDS: Final = 256  # an SGLang holder's rank s listens at its kv_endpoint + s (shard_endpoint)


class MemberTable:
    """The members one process knows: the union of what each of its gateways' `Members` said (a worker
    of a cluster with several gateways has one control session per gateway, each a `source`; the last
    list of each source counts, and where two list the same key the newer incarnation does). Readers may
    be on any thread: an update replaces one immutable snapshot."""

    def __init__(self, members: Iterable[Member] = (), gateway_keys: Iterable[str] = ()) -> None:
        self._snap = _EMPTY
        self._sources: dict[int, tuple[list[Member], list[str]]] = {}
        self._lock = threading.Lock()
        self.updates = 0
        if members or gateway_keys:
            self.replace(members, gateway_keys)

    def replace(
        self, members: Iterable[Member], gateway_keys: Iterable[str] = (), *, source: object = None
    ) -> None:
        """`source`'s new member list (None: the one source of a single-gateway process). Entries with
        a malformed key are left out."""
        with self._lock:
            self._sources[0 if source is None else id(source)] = (list(members), list(gateway_keys))
            self._rebuild()

    def forget(self, source: object) -> None:
        """Drop what `source` said (it is gone for good)."""
        with self._lock:
            if self._sources.pop(id(source), None) is not None:
                self._rebuild()

    def apply(self, msg: pb.Members, *, source: object = None) -> None:
        """A `Members` message from a gateway (its control session is `source`)."""
        self.replace(
            (
                Member(m.worker_id, m.incarnation, m.plane_key, m.kv_endpoint, m.draft_endpoint)
                for m in msg.members
            ),
            msg.gateway_keys,
            source=source,
        )

    def _rebuild(self) -> None:
        by_key: dict[str, Member] = {}
        for members, _ in self._sources.values():
            for m in members:
                if not is_key(m.key) or not m.worker_id:
                    continue
                old = by_key.get(m.key)
                if old is None or m.incarnation > old.incarnation:
                    by_key[m.key] = m
        by_endpoint: dict[str, str] = {}
        by_worker: dict[str, Member] = {}
        for m in by_key.values():
            seen = by_worker.get(m.worker_id)
            if seen is None or m.incarnation > seen.incarnation:
                by_worker[m.worker_id] = m
            for e in (m.kv_endpoint, m.draft_endpoint):
                if e:
                    by_endpoint[e] = m.key
        gateways = frozenset(k for _, keys in self._sources.values() for k in keys if is_key(k))
        self._snap = _Snapshot(by_key, by_endpoint, by_worker, gateways)
        self.updates += 1

    def refresh(self) -> None:
        """Hook for tables fed from elsewhere (`FileMemberTable`); called before each lookup."""

    # -- lookups --------------------------------------------------------------------------------
    def member(self, key: str | None) -> Member | None:
        """The current member whose key this is, or None."""
        if not key:
            return None
        self.refresh()
        return self._snap.by_key.get(key)

    def is_gateway(self, key: str | None) -> bool:
        self.refresh()
        return bool(key) and key in self._snap.gateways

    def allows(self, key: str, *, gateways: bool) -> bool:
        """Whether a client with this key may connect (members; the gateways too where `gateways`)."""
        self.refresh()
        snap = self._snap
        return key in snap.by_key or (gateways and key in snap.gateways)

    def current(self, worker_id: str) -> Member | None:
        """The member entry of `worker_id` (its current incarnation), or None."""
        self.refresh()
        return self._snap.by_worker.get(worker_id)

    def server_key(self, endpoint: str) -> str | None:
        """The key of the member listening at `endpoint` (one of its endpoints, or, for an SGLang
        holder, the endpoint of one of its ranks: the base + shard), or None when no member does."""
        self.refresh()
        snap = self._snap
        key = snap.by_endpoint.get(endpoint)
        if key is not None:
            return key
        for base in _shard_bases(endpoint):
            key = snap.by_endpoint.get(base)
            if key is not None:
                return key
        return None

    def members(self) -> list[Member]:
        self.refresh()
        return list(self._snap.by_key.values())

    def gateway_keys(self) -> frozenset[str]:
        self.refresh()
        return self._snap.gateways


def _shard_bases(endpoint: str) -> Iterable[str]:
    """The endpoints whose shard `endpoint` may be (the inverse of storage_layout.shard_endpoint)."""
    if endpoint.startswith(("ipc://", "inproc://")):
        head, sep, n = endpoint.rpartition(".shard")
        if sep and n.isdigit() and head.partition("://")[2]:
            yield head
        return
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[len("tcp://") :].rpartition(":")
        if not sep or not port.isdigit():
            return
        p = int(port)
        for s in range(1, min(MAX_SHARDS, p)):
            yield f"tcp://{host}:{p - s}"


# -- what a plane server or client is given -----------------------------------------------------
@dataclass(frozen=True, slots=True)
class PlaneAuth:
    """CURVE on a plane socket: this process's keypair, and the members it trusts."""

    keys: CurveKeypair
    members: MemberTable

    @classmethod
    def generate(cls, members: MemberTable | None = None) -> PlaneAuth:
        return cls(CurveKeypair.generate(), members if members is not None else MemberTable())


class Plaintext:
    """No CURVE, no ZAP, no identity checks: for unit tests that build a plane server or client
    directly. Never a default: production code always passes a `PlaneAuth`."""

    def __repr__(self) -> str:
        return "PLAINTEXT"


PLAINTEXT: Final = Plaintext()
Security = PlaneAuth | Plaintext


def curve_server(sock: zmq.Socket[Any], auth: PlaneAuth, domain: str) -> None:
    """Make `sock` a CURVE server whose handshakes its context's ZAP handler decides (`ZapGuard`)."""
    require_curve()
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, auth.keys.secret.encode("ascii"))
    sock.setsockopt(zmq.CURVE_PUBLICKEY, auth.keys.public.encode("ascii"))
    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode("ascii"))


def curve_client(sock: zmq.Socket[Any], keys: CurveKeypair, server_key: str) -> None:
    """Make `sock` a CURVE client that talks only to the holder of `server_key`."""
    require_curve()
    if not is_key(server_key):
        raise PlaneSecurityError(f"not a CURVE server key: {server_key[:48]!r}")
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret.encode("ascii"))
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public.encode("ascii"))
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_key.encode("ascii"))


def user_id(frame: zmq.Frame) -> str | None:
    """The authenticated client key of the connection a received frame came on (None: none)."""
    try:
        value = frame.get("User-Id")
    except zmq.ZMQError:
        return None
    return value if isinstance(value, str) and value else None


class RefusalLog:
    """Counts refusals and logs them without flooding: the first of each (reason, peer), then at most
    one line per `every_s` with the count since."""

    def __init__(self, event: str, every_s: float = 1.0) -> None:
        self.event = event
        self.every_s = every_s
        self.total = 0
        self._last: dict[tuple[str, str], tuple[float, int]] = {}

    def __call__(self, reason: str, peer: str | None, **fields: object) -> None:
        self.total += 1
        k = (reason, peer or "")
        now = time.monotonic()
        last = self._last.get(k)
        if last is None or now - last[0] >= self.every_s:
            log.warning(
                self.event, reason=reason, peer=(peer or "")[:12], repeated=last[1] if last else 0, **fields
            )
            if len(self._last) > 4096:
                self._last.clear()
            self._last[k] = (now, 0)
        else:
            self._last[k] = (last[0], last[1] + 1)


# -- failed handshakes on a server socket --------------------------------------------------------
# a peer without CURVE (mechanism mismatch), with another server key, or refused by ZAP
HANDSHAKE_FAILURES: Final = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


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
                if ev.get("event", 0) & HANDSHAKE_FAILURES:
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

    def __init__(self, ctx: zmq.asyncio.Context, *, wait_s: float = KEY_WAIT_S) -> None:
        self.ctx = ctx
        self.wait_s = wait_s
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


# -- the plane file of an SGLang server (written by its sidecar agent) ----------------------------
@dataclass(frozen=True, slots=True)
class PlaneFile:
    keys: dict[str, CurveKeypair]  # worker id -> its keypair (one per server; tests may hold several)
    members: list[Member]
    gateway_keys: list[str]
    seq: int = 0


def write_plane_file(path: Path, plane: PlaneFile) -> None:
    """Write atomically, readable by its owner only (the folder too when it is created)."""
    body = {
        "v": PLANE_FILE_VERSION,
        "seq": plane.seq,
        "keys": {w: {"public": k.public, "secret": k.secret} for w, k in plane.keys.items()},
        "members": [
            {
                "worker_id": m.worker_id,
                "incarnation": m.incarnation,
                "key": m.key,
                "kv_endpoint": m.kv_endpoint,
                "draft_endpoint": m.draft_endpoint,
            }
            for m in plane.members
        ],
        "gateway_keys": list(plane.gateway_keys),
    }
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, json.dumps(body).encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_plane_file(path: Path) -> PlaneFile:
    """The plane file at `path`; PlaneSecurityError if it is missing, malformed, or accessible to
    other users (as ssh refuses such a key)."""
    try:
        st = path.stat()
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise PlaneSecurityError(
                f"plane file {path} is accessible by other users (mode {stat.S_IMODE(st.st_mode):o})"
            )
        raw = json.loads(path.read_bytes())
    except OSError as exc:
        raise PlaneSecurityError(f"plane file {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise PlaneSecurityError(f"plane file {path} is not JSON: {exc}") from exc
    try:
        if raw.get("v") != PLANE_FILE_VERSION:
            raise PlaneSecurityError(
                f"plane file {path}: version {raw.get('v')!r}, expected {PLANE_FILE_VERSION}"
            )
        keys = {str(w): CurveKeypair(str(k["public"]), str(k["secret"])) for w, k in raw["keys"].items()}
        members = [
            Member(
                str(m["worker_id"]),
                int(m["incarnation"]),
                str(m["key"]),
                str(m.get("kv_endpoint", "")),
                str(m.get("draft_endpoint", "")),
            )
            for m in raw.get("members", [])
        ]
        return PlaneFile(keys, members, [str(k) for k in raw.get("gateway_keys", [])], int(raw.get("seq", 0)))
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise PlaneSecurityError(f"plane file {path} is malformed: {exc!r}") from exc


class FileMemberTable(MemberTable):
    """A MemberTable that follows a plane file (re-read when its mtime or size changes, looked at no
    more often than every `recheck_s`). A file that cannot be read keeps the last members."""

    def __init__(self, path: Path, *, recheck_s: float = FILE_RECHECK_S) -> None:
        super().__init__()
        self.path = path
        self.recheck_s = recheck_s
        self._checked = -1.0
        self._stamp: tuple[int, int, int] | None = None
        self._file_lock = threading.Lock()
        self.refresh()

    def refresh(self) -> None:
        now = time.monotonic()
        if now - self._checked < self.recheck_s:
            return
        with self._file_lock:
            if now - self._checked < self.recheck_s:
                return
            self._checked = now
            try:
                st = self.path.stat()
            except OSError:
                return
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            if stamp == self._stamp:
                return
            try:
                plane = read_plane_file(self.path)
            except PlaneSecurityError as exc:
                log.warning("plane_file_unreadable", path=str(self.path), error=str(exc))
                return
            self._stamp = stamp
            self.replace(plane.members, plane.gateway_keys)


def auth_from_plane_file(worker_id: str, path: str | os.PathLike[str] | None = None) -> PlaneAuth:
    """The PlaneAuth of `worker_id` inside an SGLang server: its keypair and members from the plane
    file (`path`, else the file `LUMEN_PLANE_FILE` names). PlaneSecurityError when there is none."""
    return FileKeyring(path)(worker_id)


class Keyring(Protocol):
    """The plane security to send under as a given worker id (a process that sends for whatever worker
    its requests name, e.g. Lumen's SGLang plugin); PlaneSecurityError when it holds no keys for it."""

    def __call__(self, worker_id: str) -> Security: ...


def plaintext_keyring(worker_id: str) -> Security:
    """Tests only."""
    return PLAINTEXT


class FileKeyring:
    """The keys of the plane file (`path`, else `LUMEN_PLANE_FILE`), one PlaneAuth per worker id, all
    sharing one FileMemberTable. PlaneSecurityError at construction when there is no plane file."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        where = path if path is not None else os.environ.get(PLANE_FILE_ENV, "")
        if not where:
            raise PlaneSecurityError(
                f"no plane file: Lumen's KV plane needs CURVE keys, which the sidecar agent writes to the 0600 "
                f"file named by {PLANE_FILE_ENV} (lumen sglang-agent sets it for a server it launches)"
            )
        require_curve()
        self.path = Path(where)
        read_plane_file(self.path)  # refused now, not at the first page, if unusable
        self.members = FileMemberTable(self.path)
        self._auth: dict[str, PlaneAuth] = {}
        self._lock = threading.Lock()

    def __call__(self, worker_id: str) -> PlaneAuth:
        auth = self._auth.get(worker_id)
        if auth is not None:
            return auth
        with self._lock:
            keys = read_plane_file(self.path).keys.get(worker_id)
            if keys is None:
                raise PlaneSecurityError(f"plane file {self.path} has no keys for worker {worker_id!r}")
            auth = self._auth[worker_id] = PlaneAuth(keys, self.members)
            return auth


def members_message(members: Iterable[Member], gateway_keys: Iterable[str], seq: int) -> pb.GatewayMessage:
    """The `Members` command the gateway sends (incarnation filled in by the control plane)."""
    return pb.GatewayMessage(
        members=pb.Members(
            seq=seq,
            members=[
                pb.PlaneMember(
                    worker_id=m.worker_id,
                    incarnation=m.incarnation,
                    plane_key=m.key,
                    kv_endpoint=m.kv_endpoint,
                    draft_endpoint=m.draft_endpoint,
                )
                for m in members
            ],
            gateway_keys=list(gateway_keys),
        )
    )
