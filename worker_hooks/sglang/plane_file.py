"""The sidecar agent's half of the KV plane's security for its SGLang server (gateway/protocol/planes.py).

Lumen's code inside the SGLang server (the HiCache page store, the decode-time plugin) speaks on the KV
plane, but the server is not on the control plane: its agent is. So the agent holds the server's CURVE
keypair (announced as the Hello's `plane_key`) and the members the gateways send, and writes both to
the server's *plane file*, a JSON file only its owner can read (0600, in a 0700 folder), whose path
reaches the server in its environment (`LUMEN_PLANE_FILE`), never on its command line. The server's
processes read their keys once and follow the members as the file changes (`FileMemberTable`).

The path is the agent's `LUMEN_PLANE_FILE` when set (a server the agent does not launch must be given
the same path; keys already in that file for this worker are kept, so a running server stays valid
across agent restarts), else a file in a fresh private temporary folder, removed when the agent stops.
With several gateways, the members of all their sessions are merged (`MemberTable`: the union, the
newer incarnation where two list the same key).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import structlog

from gateway.protocol import control_pb2 as pb
from gateway.protocol.plane_file import PLANE_FILE_ENV, PlaneFile, read_plane_file, write_plane_file
from gateway.protocol.planes import CurveKeypair, MemberTable, PlaneSecurityError

log = structlog.get_logger(__name__)


class ServerPlanes:
    """One SGLang server's plane keys and members, as its agent keeps them and writes them."""

    def __init__(self, worker_id: str, path: str = "") -> None:
        self.worker_id = worker_id
        self._own_dir: Path | None = None
        self._given = Path(path) if path else None
        keys: CurveKeypair | None = None
        if self._given is not None and self._given.exists():
            try:
                keys = read_plane_file(self._given).keys.get(worker_id)
            except PlaneSecurityError as exc:
                log.warning("plane file replaced", path=path, error=str(exc))
        self.keys = keys if keys is not None else CurveKeypair.generate()
        self.members = MemberTable()  # the union of every gateway session's Members
        self.seq = 0
        if self._given is not None:
            self.write()  # a server given this path may already be reading it

    @property
    def path(self) -> Path:
        """The file (a private one is made on first use)."""
        if self._given is not None:
            return self._given
        if self._own_dir is None:
            self._own_dir = Path(tempfile.mkdtemp(prefix="lumen-plane-"))  # 0700
        return self._own_dir / f"{self.worker_id}.json"

    @property
    def env(self) -> dict[str, str]:
        """What the server's environment needs to find the file (written now if it is not yet)."""
        if not self.path.exists():
            self.write()
        return {PLANE_FILE_ENV: str(self.path)}

    def update(self, session: object, msg: pb.Members) -> None:
        """One gateway session's Members: the file now lists them (merged with the other sessions')."""
        self.members.apply(msg, source=session)
        self.write()

    def write(self) -> None:
        self.seq += 1
        members, gateways = self.members.members(), sorted(self.members.gateway_keys())
        write_plane_file(self.path, PlaneFile({self.worker_id: self.keys}, members, gateways, self.seq))

    def close(self) -> None:
        """Remove the file (and its folder) if the agent chose them; a given path is left as it is."""
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
            self._own_dir = None
