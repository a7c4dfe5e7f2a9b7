"""Where a server's holder stores listen (one per TP/PP rank), where their status sockets are, and the
`"lumen"` options of the storage backend's extra config (docs/sglang.md)."""

from __future__ import annotations

import hashlib
import importlib
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from gateway.protocol.launch import Eviction
from gateway.protocol.secrets import runtime_dir
from worker_hooks.sglang.page_routes import RouteLookup

# an ipc:// path longer than this does not fit a Unix socket address (sun_path, 108 bytes with its NUL)
MAX_IPC_PATH: Final = 107


# -- shards ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ShardLayout:
    """Which holder store a rank owns and which ones its writes go to, per server."""

    own: int  # this rank's store (and endpoint offset)
    write_to: tuple[int, ...]  # the holder ranks that need this rank's pages
    count: int  # stores per server


def shard_layout(
    *,
    tp_rank: int,
    tp_size: int,
    pp_rank: int = 0,
    pp_size: int = 1,
    cp_rank: int = 0,
    cp_size: int = 1,
    rank_replicated: bool = False,
) -> ShardLayout:
    """One store per rank, numbered ((pp_rank · cp_size) + cp_rank) · tp_size + tp_rank. A TP-sharded
    cache's rank writes to the same rank of the holder; a rank-replicated (MLA) cache's writer writes
    to every TP rank of its (pp, cp) group, since each of them reads the whole page."""
    for name, rank, size in (("tp", tp_rank, tp_size), ("pp", pp_rank, pp_size), ("cp", cp_rank, cp_size)):
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"{name} rank {rank} outside [0, {size})")
    group = (pp_rank * cp_size + cp_rank) * tp_size
    own = group + tp_rank
    write_to = tuple(range(group, group + tp_size)) if rank_replicated else (own,)
    return ShardLayout(own, write_to, pp_size * cp_size * tp_size)


def shard_endpoint(base: str, shard: int) -> str:
    """The endpoint of shard `shard` of the holder whose (shard 0) endpoint is `base`: tcp port + shard,
    ipc/inproc path + `.shard<n>`. Shard 0 is `base` itself, so a one-shard SGLang holder and Lumen's
    own engines share one addressing."""
    if shard < 0:
        raise ValueError(f"shard must be >= 0, got {shard}")
    if base.startswith("tcp://"):
        host, sep, port = base[len("tcp://") :].rpartition(":")
        if not host or not sep or not port.isdigit():
            raise ValueError(f"tcp endpoint needs host:port, got {base!r}")
        if shard == 0:
            return base
        if int(port) == 0:
            raise ValueError(f"a sharded tcp endpoint needs a fixed port, got {base!r}")
        if int(port) + shard > 65535:
            raise ValueError(f"{base!r} + shard {shard} is past port 65535")
        return f"tcp://{host}:{int(port) + shard}"
    if base.startswith(("ipc://", "inproc://")) and base.partition("://")[2]:
        return base if shard == 0 else f"{base}.shard{shard}"
    raise ValueError(f"unsupported endpoint {base!r} (tcp://, ipc:// or inproc://)")


def status_endpoint_for(holder_endpoint: str) -> str:
    """The default base (shard 0) endpoint of the status sockets of the holder whose shard-0 holder
    endpoint is `holder_endpoint`; shard s answers at `shard_endpoint(base, s)`, beside its holder
    store. A local ipc socket named by a hash of the holder endpoint as written in the storage config,
    so the agent on the same host derives the same one from the same config without a second port:
    `ipc://<runtime dir>/holder-status-<16 hex digits of blake2b(holder_endpoint)>` (+ `.shard<n>`),
    where the runtime directory is the user's own, mode 0700 ($XDG_RUNTIME_DIR/lumen, else
    ~/.lumen/run: gateway.protocol.secrets.runtime_dir), so no other user can bind it first (issue 29:
    a predictable name in /tmp could be squatted). The `"lumen"` option `status_endpoint` overrides it
    (e.g. for an agent in another container)."""
    digest = hashlib.blake2b(holder_endpoint.encode(), digest_size=8).hexdigest()
    path = f"{runtime_dir()}/holder-status-{digest}"
    if len(path.encode()) + len(".shard999") > MAX_IPC_PATH:
        raise ValueError(
            f"the holder status socket path {path!r} is too long for a Unix socket: set a shorter "
            "XDG_RUNTIME_DIR, or the lumen option status_endpoint"
        )
    return f"ipc://{path}"


# -- configuration --------------------------------------------------------------------------------
class LumenStorageOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The `"lumen"` object of SGLang's `--hicache-storage-backend-extra-config` (docs/sglang.md)."""

    worker_id: str  # this server's Lumen worker id: `src_worker` of every page it checkpoints
    incarnation: int = 0  # its incarnation: holders fence pages of older ones
    # where this server's holder store listens (shard 0; shard s: `shard_endpoint`); None: no store
    holder_endpoint: str | None = None
    holder_budget_bytes: int = 0  # host memory for other workers' pages, whole server (split by shard)
    # the holder's status sockets (shard 0; shard s: `shard_endpoint`), which the agent polls; None:
    # `status_endpoint_for(holder_endpoint)`
    status_endpoint: str | None = None
    eviction: Eviction = Eviction.SHORTEST_PREFIX_FIRST
    # SGLang writes a request's pages after prefill and at finish, nothing while it decodes: a holder
    # must keep a quiet checkpoint far longer than Lumen's own (30 s, refreshed every step)
    orphan_ttl_s: float = 600.0
    frame_bytes: int = 1 << 20
    max_lag_bytes: int = 256 << 20  # per holder: beyond it a request is abandoned there
    max_pending_bytes: int = 64 << 20  # copied pages not yet queued by the KV plane: beyond it, dropped
    # "module:attr": a RouteLookup (key -> [PageRoute]) that a plugin in the same process fills;
    # None: the backend's own RequestRoutes table (`LumenHiCacheStorage.routes`)
    route_provider: str | None = None

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("lumen.worker_id must not be empty")
        if self.incarnation < 0 or self.holder_budget_bytes < 0:
            raise ValueError("lumen.incarnation and lumen.holder_budget_bytes must be >= 0")
        if self.orphan_ttl_s <= 0 or min(self.frame_bytes, self.max_lag_bytes, self.max_pending_bytes) < 1:
            raise ValueError("lumen.orphan_ttl_s, frame_bytes, max_lag_bytes, max_pending_bytes must be > 0")
        if self.holder_endpoint is not None:
            shard_endpoint(self.holder_endpoint, 0)  # a malformed endpoint is refused here, not at bind
        if self.status_endpoint is not None:
            shard_endpoint(self.status_endpoint, 0)


def options_from_extra_config(extra_config: dict[str, Any] | None) -> LumenStorageOptions:
    """Lumen's options from SGLang's extra config; a clear ValueError naming the key otherwise."""
    raw = (extra_config or {}).get("lumen")
    if not isinstance(raw, dict):
        raise ValueError('the extra config needs a "lumen" object with at least "worker_id" (docs/sglang.md)')
    try:
        return msgspec.convert(raw, LumenStorageOptions)
    except msgspec.ValidationError as exc:
        raise ValueError(f"bad lumen storage option: {exc}") from exc


def load_route_provider(spec: str) -> RouteLookup:
    """The RouteLookup named by "package.module:attr"."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f'route_provider must be "module:attr", got {spec!r}')
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"route_provider {spec!r} is not callable")
    lookup: RouteLookup = obj
    return lookup
