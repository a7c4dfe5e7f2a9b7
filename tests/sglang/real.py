"""Real SGLang servers for the real-SGLang lane: unmodified `sglang==0.5.23` on CPU, tiny random models.

`tiny_models()` builds the target and draft models once per lane environment (worker_hooks/sglang/
tiny_model.py; cached under the venv, keyed by the builder's source). `SGLangServer` starts one
`python -m sglang.launch_server` child in its own process group with the CPU environment Lumen's
launcher gives (`cpu_environment`), waits until `/health` answers 200, and is ended by its pid.
`gateway_argv` is `lumen gateway` in front of such servers, with the tiny tokenizer.

Each server takes ~20 s to start on an idle 2-core machine (mostly imports) and ~1 GB per process
(three per server), so the lane shares servers between tests where it can.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

from loadtests.cluster_proc import free_port
from worker_hooks.sglang import tiny_model
from worker_hooks.sglang.launcher import cpu_environment

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(sys.prefix) / "lumen-tiny-models"
START_TIMEOUT_S = 180.0
# what every server of the lane runs with: float32 (bf16 replays are not bit-equal on CPU: docs/sglang.md)
CPU_ARGS = ("--device", "cpu", "--dtype", "float32", "--max-total-tokens", "4096")
MODEL_NAME = "tiny"


def tiny_models() -> dict[str, Path]:
    """The target and draft directories, built on first use (a few seconds)."""
    key = hashlib.blake2b(Path(tiny_model.__file__).read_bytes(), digest_size=8).hexdigest()
    out = CACHE / key
    if not (out / "lumen-tiny.json").exists():
        tmp = CACHE / f"{key}.tmp{os.getpid()}"
        tiny_model.build(tmp)
        with contextlib.suppress(FileExistsError, OSError):
            tmp.rename(out)
    return {name: out / name for name in tiny_model.SHAPES}


def server_port() -> int:
    """A port for a server: SGLang also listens at port+1 and derives others from it."""
    return free_port(2)


class SGLangServer:
    """One real SGLang server, a child in its own process group; `kill()` is kill -9 of the whole group."""

    def __init__(self, model: Path, log: Path, *extra: str, port: int | None = None) -> None:
        self.extra: tuple[str, ...] = extra
        self.port = port or server_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        argv = [
            sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
            "--host", "127.0.0.1", "--port", str(self.port), *CPU_ARGS, *extra,
        ]  # fmt: skip
        self._log = log.open("w")
        env = dict(os.environ, **cpu_environment(argv, os.environ))
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            env=env, start_new_session=True,
        )  # fmt: skip

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> SGLangServer:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang server exited ({self.proc.returncode}); see {self.log_path}")
            with (
                contextlib.suppress(OSError, urllib.error.URLError),
                urllib.request.urlopen(f"{self.url}/health", timeout=5) as resp,
            ):
                if resp.status == 200:
                    return self
            time.sleep(0.25)
        raise TimeoutError(f"sglang server not healthy in {timeout_s} s; see {self.log_path}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.alive():
            self.kill()
        self._log.close()

    def generate(self, body: dict[str, Any]) -> Any:
        """One plain `/generate` straight to the server (the reference a test compares against)."""
        return post_json(f"{self.url}/generate", body)


def server_headers() -> dict[str, str]:
    """The bearer of the lane's SGLang key (conftest.py puts LUMEN_SGLANG_API_KEY in the environment:
    the agents launch their servers with it, the gateways send it), for a test's own direct calls."""
    key = os.environ.get("LUMEN_SGLANG_API_KEY", "")
    return {"Authorization": f"Bearer {key}"} if key else {}


def post_json(url: str, body: dict[str, Any], timeout_s: float = 120.0) -> Any:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json", **server_headers()}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def gateway_settings(models: dict[str, Path]) -> list[str]:
    """`--set` arguments that give a gateway the tiny model's tokenizer and chat template."""
    target = models["target"]
    return [
        "--set", 'tokenizer.kind="hf"',
        "--set", f'tokenizer.path="{target / "tokenizer.json"}"',
        "--set", f'tokenizer.chat_template="{target / "chat_template.jinja"}"',
        "--set", f'gateway.served_model_name="{MODEL_NAME}"',
        "--set", 'gateway.log_level="info"',
    ]  # fmt: skip


class ServerPool:
    """Real servers of the tiny target shared across a lane's tests: `live(n)` gives n running servers,
    starting (in parallel) what is missing, so a test that kills one costs the next test one start."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.models = tiny_models()
        self.servers: list[SGLangServer] = []
        self.started = 0

    def live(self, n: int, *extra: str) -> list[SGLangServer]:
        for s in [s for s in self.servers if not s.alive() or s.extra != extra]:
            s.stop()
            self.servers.remove(s)
        fresh = []
        while len(self.servers) < n:
            self.started += 1
            s = SGLangServer(self.models["target"], self.logs / f"sglang-{self.started}.log", *extra)
            self.servers.append(s)
            fresh.append(s)
        for s in fresh:
            s.wait_ready()
        return self.servers[:n]

    def close(self) -> None:
        for s in self.servers:
            s.stop()
        self.servers.clear()


async def stream_generate(
    http: aiohttp.ClientSession, body: dict[str, Any], seen: list[int], url: str = ""
) -> list[int]:
    """`/generate` streamed through a gateway (at `url`, or the session's base URL); `seen` holds the
    cumulative ids as they come, so a test can tell when every stream is mid-way."""
    async with http.post(f"{url}/generate", json={**body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.strip()
            if line.startswith(b"data:") and line != b"data: [DONE]":
                chunk = json.loads(line[5:])
                assert "error" not in chunk, chunk
                seen[:] = chunk["output_ids"]
    return list(seen)
