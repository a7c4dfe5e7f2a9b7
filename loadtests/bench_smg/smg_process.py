"""SMG (`pip install smg`, the SGLang model gateway) for the overhead bench: found or installed in this
venv, launched on loopback in front of the workers, and probed once per endpoint."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from loadtests.cluster_proc import free_port


def smg_binary(install: bool) -> tuple[str | None, str]:
    exe = Path(sys.executable).parent / "smg"
    if importlib.util.find_spec("smg") is None or not exe.exists():
        if not install:
            return None, "smg is not installed (run `pip install smg` in this venv, or drop --no-install)"
        print("installing smg into this venv (pip install smg)...", file=sys.stderr)
        r = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "smg"], capture_output=True, text=True
        )
        if r.returncode != 0 or not exe.exists():
            return None, f"`pip install smg` failed: {r.stderr.strip()[-400:]}"
    ver = subprocess.run([sys.executable, "-m", "pip", "show", "smg"], capture_output=True, text=True).stdout
    version = next((ln.split(":", 1)[1].strip() for ln in ver.splitlines() if ln.startswith("Version:")), "?")
    return str(exe), version


class Smg:
    """`smg launch` on loopback (metrics too), stopped by its pid."""

    def __init__(
        self, exe: str, worker_urls: list[str], policy: str, log_path: Path, worker_api_key: str = ""
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.n = len(worker_urls)
        self.cmd = [
            exe, "launch", "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--worker-urls", *worker_urls, "--policy", policy, "--log-level", "warn",
            "--shutdown-grace-period-secs", "1",
        ]  # fmt: skip
        if worker_api_key:  # SMG's bearer towards the workers
            self.cmd += ["--api-key", worker_api_key]
        self.log = log_path.open("w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT)

    async def ready(self, http: aiohttp.ClientSession, timeout_s: float = 60.0) -> dict[str, Any]:
        """SMG says ready on GET /readiness once its workers passed discovery and health checks."""
        deadline = time.monotonic() + timeout_s
        last: dict[str, Any] = {}
        while time.monotonic() < deadline and self.proc.poll() is None:
            with contextlib.suppress(aiohttp.ClientError, json.JSONDecodeError):
                async with http.get(self.url + "/readiness") as r:
                    last = dict(json.loads(await r.text()))
                    if last.get("status") == "ready" and last.get("healthy_workers") == self.n:
                        return last
            await asyncio.sleep(0.25)
        raise RuntimeError(f"SMG not ready in {timeout_s:g} s (exit {self.proc.poll()}): {last}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


async def probe(
    http: aiohttp.ClientSession, base: str, model: str, api_key: str = ""
) -> dict[str, dict[str, Any]]:
    """One tiny streamed request per SMG endpoint: status and the start of the reply."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    bodies = {
        "/v1/completions": {
            "model": model,
            "prompt": "ABCDEFGH",
            "max_tokens": 4,
            "stream": True,
            "ignore_eos": True,
        },
        "/v1/chat/completions": {
            "model": model,
            "messages": [{"role": "user", "content": "ABCDEFGH"}],
            "max_tokens": 4,
            "stream": True,
            "ignore_eos": True,
        },
        "/generate": {
            "input_ids": list(range(65, 73)),
            "sampling_params": {"max_new_tokens": 4},
            "stream": True,
        },
    }
    out = {}
    for path, body in bodies.items():
        try:
            async with http.post(base + path, json=body, headers=headers) as r:
                text = await r.text()
                ok = r.status == 200 and "[DONE]" in text and "error" not in text
                out[path] = {"ok": ok, "status": r.status, "reply": text[:300]}
        except aiohttp.ClientError as exc:
            out[path] = {"ok": False, "status": None, "reply": f"{type(exc).__name__}: {exc}"}
    return out
