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

import errno
import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

TOKEN_ENV = "LUMEN_CONTROL_TOKEN"
TOKEN_FILE_ENV = "LUMEN_CONTROL_TOKEN_FILE"
TOKEN_BYTES = 32  # a generated token: 32 random bytes, URL-safe base64 (43 characters)
_WORKER_HTTP_LABEL = b"lumen worker http v1"


class SecretError(Exception):
    """A token file that is missing, empty, readable by others or not ours, or a runtime directory
    that is not ours (the message says which)."""


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
    """Where a gateway keeps what it generated (control token, admin key) and where local runtime
    sockets live: $XDG_RUNTIME_DIR/lumen, else ~/.lumen/run. Per user, mode 0700 (`private_dir`)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    return Path(base) / "lumen" if base else Path.home() / ".lumen" / "run"


def private_dir(path: Path) -> Path:
    """`path` as a directory only this user can enter: created with mode 0700 (its missing parents
    too); refused (SecretError) when it is a symbolic link, not a directory, or another user's. One of
    ours that others may enter is narrowed to 0700."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        raise SecretError(f"runtime directory {path}: {exc.strerror or exc}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise SecretError(f"runtime directory {path} is not a directory (a symbolic link?); remove it")
    if st.st_uid != os.geteuid():
        raise SecretError(
            f"runtime directory {path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
        )
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        os.chmod(path, 0o700)
    return path


def private_runtime_dir() -> Path:
    """`runtime_dir()`, created (0700) and checked to be this user's alone."""
    return private_dir(runtime_dir())


def default_token_path(control_port: int) -> Path:
    return runtime_dir() / f"control-token-{control_port}"


def write_token_file(path: Path, token: str) -> None:
    """Write `token` to `path`, readable by its owner only (the folder too when it is created).

    Written to a new temporary file beside it (a random name, created with O_EXCL and O_NOFOLLOW, so
    a file or link planted there is never written through), fsynced, then renamed over `path` (a
    rename replaces a link at `path`, never follows it)."""
    if path.parent == runtime_dir():
        private_dir(path.parent)
    else:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600)
    try:
        try:
            os.write(fd, token.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


MAX_TOKEN_FILE_BYTES = 64 << 10


def read_token_file(path: Path, what: str = "control token file") -> str:
    """The token in `path`, refused (SecretError) unless `path` is a regular file (not a symbolic
    link: opened with O_NOFOLLOW) owned by this user and accessible by nobody else, as ssh refuses
    such a key, and not empty. Owner and mode are read from the open file (fstat), so the file checked
    is the file read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SecretError(f"{what} {path} is a symbolic link; give the file itself") from exc
        raise SecretError(f"{what} {path}: {exc.strerror or exc}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SecretError(f"{what} {path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise SecretError(
                f"{what} {path} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()}); "
                "a token file must be the reader's own"
            )
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SecretError(
                f"{what} {path} is accessible by other users (mode {stat.S_IMODE(st.st_mode):o}); chmod 600 it"
            )
        data = os.read(fd, MAX_TOKEN_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_TOKEN_FILE_BYTES:
        raise SecretError(f"{what} {path} is larger than {MAX_TOKEN_FILE_BYTES} bytes")
    token = data.decode(errors="replace").strip()
    if not token:
        raise SecretError(f"{what} {path} is empty")
    return token


# -- the admin key ---------------------------------------------------------------------------------
# The admin API is never open: a gateway (or a `lumen cluster up` supervisor) configured with no
# admin key generates one and keeps it as the control token, in a 0600 file of the runtime directory
# named by the gateway's HTTP port, where the owner's `lumen` commands and test tools find it.
ADMIN_KEYS_ENV = "LUMEN_ADMIN_API_KEYS"
ADMIN_KEY_ENV = "LUMEN_ADMIN_API_KEY"


def default_admin_key_path(http_port: int) -> Path:
    return runtime_dir() / f"admin-key-{http_port}"


def admin_key_for(http_port: int | None, env: Mapping[str, str] | None = None) -> str | None:
    """The admin key a client of the gateway on `http_port` presents: the first of
    LUMEN_ADMIN_API_KEYS (what the gateway reads its keys from), else LUMEN_ADMIN_API_KEY, else the
    key in the port's default file (a generated one); None when there is none."""
    env = os.environ if env is None else env
    keys = [k.strip() for k in env.get(ADMIN_KEYS_ENV, "").split(",") if k.strip()]
    if keys:
        return keys[0]
    if env.get(ADMIN_KEY_ENV):
        return env[ADMIN_KEY_ENV]
    if http_port is None:
        return None
    path = default_admin_key_path(http_port)
    if not path.exists():
        return None
    return read_token_file(path, "admin key file")


def admin_headers(url: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The `Authorization` header for /admin of the gateway at `url` ({} when no key is found)."""
    key = admin_key_for(urlsplit(url).port, env)
    return {"Authorization": f"Bearer {key}"} if key else {}


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
