"""Run `lumen cluster up` as a child process (real processes on loopback) for demos, tests and benchmarks."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Any


def free_port(n: int = 1) -> int:
    """A free port on loopback; with n > 1, the first of n consecutive free ones."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if n == 1 or all(_free(base + i) for i in range(1, n)):
            return base
    raise OSError(f"no {n} consecutive free ports found")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _pump(stream: IO[str], lines: queue.Queue[str]) -> None:
    """Every line of `stream` into `lines`, then "" (its end, or its closing by `stop`)."""
    with contextlib.suppress(ValueError, OSError):
        for line in stream:
            lines.put(line)
    lines.put("")


class ClusterProcess:
    """`with ClusterProcess(workers=3, overrides={...}) as c: c.url`; stops the cluster on exit."""

    def __init__(
        self,
        *,
        workers: int = 3,
        port: int = 0,
        mode: str | None = None,
        config: str | None = None,
        overrides: dict[str, Any] | None = None,
        log_dir: Path | None = None,
        ready_timeout_s: float = 60.0,
        env: dict[str, str] | None = None,
        gateways: int = 1,
        shared_port: bool = False,
    ) -> None:
        self.port = port or free_port(1 if shared_port else gateways)
        self.url = f"http://127.0.0.1:{self.port}"
        self.gateways = gateways
        cmd = [
            sys.executable,
            "-m",
            "gateway.cli",
            "cluster",
            "up",
            "--workers",
            str(workers),
            "--port",
            str(self.port),
        ]
        if gateways != 1:
            cmd += ["--gateways", str(gateways)]
        if shared_port:
            cmd += ["--shared-port"]
        if mode:
            cmd += ["--mode", mode]
        if config:
            cmd += ["--config", config]
        if log_dir:
            cmd += ["--log-dir", str(log_dir)]
        # a test cluster: its workers take `POST /lumen/fault` (slow faults)
        for k, v in {"cluster.fault_injection": True, **(overrides or {})}.items():
            cmd += ["--set", f"{k}={json.dumps(v)}"]
        self.cmd = cmd
        self.env = None if env is None else {**os.environ, **env}
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen[str] | None = None
        self.ready: dict[str, Any] = {}
        self.stderr_path = (
            log_dir or Path(os.environ.get("TMPDIR", "/tmp"))
        ) / f"lumen-cluster-{self.port}.stderr"

    def __enter__(self) -> ClusterProcess:
        self.stderr_path.parent.mkdir(parents=True, exist_ok=True)
        self._stderr = self.stderr_path.open("w")
        self.proc = subprocess.Popen(
            self.cmd, stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=self.env
        )
        deadline = time.monotonic() + self.ready_timeout_s
        assert self.proc.stdout is not None
        # the child's stdout is read on a thread, so the deadline holds while it prints nothing
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=_pump, args=(self.proc.stdout, lines), daemon=True).start()
        while self.ready.get("event") is None:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if not line:
                break
            self._take(line)
        if self.ready.get("event") != "ready":
            self.stop()
            raise RuntimeError(
                f"cluster did not become ready in {self.ready_timeout_s:g} s: {self.ready}; "
                f"stderr: {self.stderr_tail()}"
            )
        return self

    def _take(self, line: str) -> None:
        """Keep the ready (or degraded) line of `lumen cluster up`; other lines are not ours."""
        try:
            msg = json.loads(line)
        except json.JSONDecodeError:
            return
        if isinstance(msg, dict) and msg.get("event") in ("ready", "degraded"):
            self.ready = msg

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def stop(self, timeout_s: float = 15.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()
        return self.proc.returncode

    def stderr_tail(self, n: int = 4000) -> str:
        try:
            return self.stderr_path.read_text()[-n:]
        except OSError:
            return ""
