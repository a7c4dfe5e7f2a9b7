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

import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import structlog
import zmq
import zmq.asyncio
from zmq.utils import z85

from gateway.protocol import control_pb2 as pb

log = structlog.get_logger("lumen.planes")

KV_DOMAIN: Final = "lumen.kv"
DRAFT_DOMAIN: Final = "lumen.draft"
KEY_LEN: Final = 40  # a Z85 CURVE key: 32 bytes


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
