"""The cluster secret: how the control-plane token travels, and what is derived from it.

One secret per cluster, the control token, authenticates a worker's Hello on the gRPC control plane.
It never goes on a command line (any local user can read argv): a worker gets it from the
environment (`LUMEN_CONTROL_TOKEN`, or a supervisor's `LUMEN_ENGINE_SPEC`) or from a file only its
owner can read (`LUMEN_CONTROL_TOKEN_FILE`, else the default file of the gateway's control port, which
a gateway that generated its token writes). A gateway configured with no token generates one: the
control plane is never open by default.

The gateway's HTTP requests to Lumen's workers carry a bearer derived from the token (HMAC-SHA256
with a fixed label), so a bearer seen on the data path does not reveal the control token.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path

TOKEN_ENV = "LUMEN_CONTROL_TOKEN"
TOKEN_FILE_ENV = "LUMEN_CONTROL_TOKEN_FILE"
TOKEN_BYTES = 32  # a generated token: 32 random bytes, URL-safe base64 (43 characters)
_WORKER_HTTP_LABEL = b"lumen worker http v1"


class SecretError(Exception):
    """A token file that is missing, empty or readable by others (the message says which)."""


def generate_token() -> str:
    return secrets.token_urlsafe(TOKEN_BYTES)


def worker_http_bearer(control_token: str) -> str:
    """The bearer the gateway presents to a Lumen worker's HTTP API; "" when there is no token."""
    if not control_token:
        return ""
    return hmac.new(control_token.encode(), _WORKER_HTTP_LABEL, hashlib.sha256).hexdigest()


def bearer_matches(header: str | None, expected: str) -> bool:
    """Whether an `Authorization` header value carries `expected` as its bearer (constant time)."""
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer ") :].strip().encode(), expected.encode())


def runtime_dir() -> Path:
    """Where a gateway writes the token it generated: $XDG_RUNTIME_DIR/lumen, else ~/.lumen/run."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    return Path(base) / "lumen" if base else Path.home() / ".lumen" / "run"


def default_token_path(control_port: int) -> Path:
    return runtime_dir() / f"control-token-{control_port}"


def write_token_file(path: Path, token: str) -> None:
    """Write `token` to `path`, readable by its owner only (the folder too when it is created)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_token_file(path: Path) -> str:
    """The token in `path`; refused (SecretError) if the file is group- or world-accessible, as ssh
    refuses such a key, or empty."""
    try:
        st = path.stat()
    except OSError as exc:
        raise SecretError(f"control token file {path}: {exc.strerror or exc}") from exc
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretError(
            f"control token file {path} is accessible by other users (mode {stat.S_IMODE(st.st_mode):o}); "
            "chmod 600 it"
        )
    token = path.read_text().strip()
    if not token:
        raise SecretError(f"control token file {path} is empty")
    return token


def resolve_token(env: dict[str, str], control_port: int | None = None) -> str:
    """A worker's token: LUMEN_CONTROL_TOKEN, else the file LUMEN_CONTROL_TOKEN_FILE names, else the
    default file of `control_port` if it exists; "" when none is found."""
    if env.get(TOKEN_ENV):
        return env[TOKEN_ENV]
    if env.get(TOKEN_FILE_ENV):
        return read_token_file(Path(env[TOKEN_FILE_ENV]))
    if control_port is not None:
        path = default_token_path(control_port)
        if path.exists():
            return read_token_file(path)
    return ""
