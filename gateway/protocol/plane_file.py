"""The plane file of an SGLang server: its CURVE keys and the gateways' members, which its sidecar
agent writes (0600) and the server's processes (Lumen's storage backend and plugin) follow
(`FileMemberTable`, `FileKeyring`); gateway/protocol/planes.py says how the planes are secured."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

import structlog

from gateway.protocol.planes import (
    PLAINTEXT,
    CurveKeypair,
    Member,
    MemberTable,
    PlaneAuth,
    PlaneSecurityError,
    Security,
    require_curve,
)

log = structlog.get_logger("lumen.planes")
# an SGLang server's keys and members: a 0600 file its sidecar agent writes, named in its environment
PLANE_FILE_ENV: Final = "LUMEN_PLANE_FILE"
PLANE_FILE_VERSION: Final = 1
FILE_RECHECK_S: Final = 0.02  # a FileMemberTable looks at its file's mtime at most this often


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
