"""The API key of the SGLang server beside the agent (issue 30).

The key is the one the user gave: `--api-key K` in the launch arguments (their own command line),
the agent's `--api-key-file PATH`, or LUMEN_SGLANG_API_KEY / LUMEN_SGLANG_API_KEY_FILE in its
environment. With `--launch` and no key given, the agent generates one. A key the agent adds to a
launch goes in a 0600 YAML file in a private directory, named by SGLang's own `--config` flag
(`api-key: K`), never on the server's command line, where `ps` shows it to every user of the host.
The agent sends the key on its own requests to the server and reports it to its gateways in Hello
(over the authenticated control plane), which send it on theirs (gateway/server/workers/server_keys.py).
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from worker_hooks.sglang.launcher import LaunchError, _flag_value

ENV_KEY = "LUMEN_SGLANG_API_KEY"
ENV_KEY_FILE = "LUMEN_SGLANG_API_KEY_FILE"


def given_key(key_file: str | None, env: Mapping[str, str]) -> str:
    """The key named outside the launch arguments: --api-key-file, else the environment, else ""."""
    path = key_file or env.get(ENV_KEY_FILE, "")
    if path:
        try:
            key = Path(path).read_text().strip()
        except OSError as exc:
            raise LaunchError(f"--api-key-file {path}: {exc.strerror}") from exc
        if not key:
            raise LaunchError(f"--api-key-file {path}: the file holds no key")
        return key
    return env.get(ENV_KEY, "")


def launch_key(tail: Sequence[str], given: str) -> tuple[list[str], str]:
    """The launch arguments and the server's key: the arguments' own `--api-key`, else `given`, else a
    generated key; one the arguments do not carry goes in through a private `--config` file. Launch
    arguments with a `--config` of their own and no `--api-key` keep `given` (or no key): SGLang reads
    one config file, and the user's is not rewritten."""
    args = list(tail)
    own = _flag_value(args, "--api-key")
    if own:
        return args, own
    if _flag_value(args, "--config") is not None:
        return args, given
    key = given or secrets.token_urlsafe(32)
    return [*args, "--config", str(_key_file(key))], key


def _key_file(key: str) -> Path:
    folder = Path(tempfile.mkdtemp(prefix="lumen-sglang-key-"))  # 0700, this process's own
    atexit.register(shutil.rmtree, folder, True)
    path = folder / "server.yaml"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        # SGLang turns each key into the flag `--<key>` as written: `api-key`, not `api_key`
        f.write(f"api-key: {json.dumps(key)}\n")  # a JSON string is a YAML string
    return path
