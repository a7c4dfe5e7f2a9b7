"""One chaos run from the machine's own namespace: the lab, the driver inside the client's namespace,
the checker, and the report.

    result = run_chaos(ChaosSetup(gateways=2, workers=3, faults=["partition:w0|gw@3+2"]), out_dir)

The lab (loadtests/chaos/netns.py) has hosts gw0..gwG-1, w0..wW-1 and client; it is torn down on the
way out whatever happens (the driver and everything it started live inside its namespaces).
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from loadtests.chaos.certs import make_cert
from loadtests.chaos.checker import CheckReport, check_history
from loadtests.chaos.netns import Lab
from loadtests.chaos.netspec import check_hosts
from loadtests.chaos.plan import PROGRESS_EVENT, Plan, split_faults
from loadtests.faults import FaultSpecError

# a lab cluster robust on a loaded 2-core machine (as the e2e suites': a late heartbeat must not fence)
LAB_OVERRIDES: dict[str, Any] = {
    "engine.time_scale": 1.0,
    "engine.model_load_s": 1.5,
    "health.heartbeat_interval_ms": 50,
    "health.heartbeat_misses": 4,
    "gateway.log_level": "info",
    "cluster.fault_injection": True,
    # pages whose writer's gateway died before its END/DROP are freed by this TTL (default 600 s):
    # short here, so the drain check sees every store empty within the run
    "checkpoint.orphan_ttl_s": 8.0,
}


@dataclass(slots=True)
class ChaosSetup:
    gateways: int = 1
    workers: int = 3
    faults: list[str] = field(default_factory=list)
    seed: int = 1
    requests: int = 40
    rate: float = 8.0
    min_out: int = 40
    max_out: int = 120
    overrides: dict[str, Any] = field(default_factory=dict)
    read_timeout_s: float = 5.0
    drain_s: float = 25.0
    deadline_s: float = 240.0


@dataclass(slots=True)
class ChaosResult:
    history: dict[str, Any]
    report: CheckReport
    out_dir: Path
    driver_rc: int


def hosts_of(setup: ChaosSetup) -> tuple[list[str], list[str], list[str]]:
    gws = [f"gw{i}" for i in range(setup.gateways)]
    ws = [f"w{i}" for i in range(setup.workers)]
    return gws, ws, [*gws, *ws, "client"]


def validate(setup: ChaosSetup) -> None:
    """Raise FaultSpecError / NetSpecError for a setup that cannot run (before any namespace exists)."""
    if not (1 <= setup.gateways <= 8 and 1 <= setup.workers <= 32):
        raise FaultSpecError("a chaos run needs 1-8 gateways and 1-32 workers")
    _, ws, names = hosts_of(setup)
    schedule, net = split_faults(setup.faults)
    schedule.check_workers(ws)
    check_hosts(net, names)


def run_chaos(
    setup: ChaosSetup, out_dir: Path, *, progress: Callable[[str], None] | None = None
) -> ChaosResult:
    """Run `setup` in a fresh lab; the history lands in out_dir/history.json, logs in out_dir/logs.
    `progress` gets a line every PROGRESS_S seconds of the load (requests ended, faults fired)."""
    validate(setup)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("history.json", "check.json"):
        (out_dir / stale).unlink(missing_ok=True)
    gws, ws, names = hosts_of(setup)
    with Lab(names) as lab:
        cert, key = make_cert(out_dir, [lab[g].addr for g in gws])
        plan = Plan(
            hosts={h: (lab[h].ns, lab[h].addr) for h in names},
            gateways=gws,
            workers=ws,
            overrides={**LAB_OVERRIDES, **setup.overrides},
            token=secrets.token_urlsafe(32),
            admin_key=secrets.token_urlsafe(24),
            cert=str(cert),
            key=str(key),
            seed=setup.seed,
            requests=setup.requests,
            rate=setup.rate,
            min_out=setup.min_out,
            max_out=setup.max_out,
            faults=list(setup.faults),
            read_timeout_s=setup.read_timeout_s,
            drain_s=setup.drain_s,
            deadline_s=setup.deadline_s,
            log_dir=str(out_dir / "logs"),
            out=str(out_dir / "history.json"),
        )
        plan_path = out_dir / "plan.json"
        plan_path.write_bytes(msgspec.json.encode(plan))
        plan_path.chmod(0o600)  # it holds the lab's control token and admin key
        with (out_dir / "driver.log").open("wb") as logf:
            proc = lab.spawn(
                "client",
                [sys.executable, "-m", "loadtests.chaos.driver", str(plan_path)],
                env=_env(),
                log=logf,
            )
            rc = _wait(proc, out_dir / "driver.log", setup.deadline_s, progress)
        plan_path.unlink()
    hist_path = out_dir / "history.json"
    history = json.loads(hist_path.read_text()) if hist_path.exists() else {"ok_start": False}
    if "error" not in history and not history.get("ok_start"):
        history["error"] = f"the driver exited with {rc} and no history; see {out_dir / 'driver.log'}"
    report = check_history(history)
    (out_dir / "check.json").write_text(json.dumps(msgspec.to_builtins(report), indent=1))
    return ChaosResult(history, report, out_dir, rc)


def _wait(
    proc: subprocess.Popen[bytes], log_path: Path, deadline_s: float, progress: Callable[[str], None] | None
) -> int:
    """The driver's exit status (killed past the deadline), passing its progress lines on meanwhile."""
    end = time.monotonic() + deadline_s
    seen = 0
    while True:
        try:
            return proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            if time.monotonic() >= end:
                proc.kill()
                return proc.wait()
        if progress is not None:
            with log_path.open("rb") as f:
                f.seek(seen)
                new = f.read()
            cut = new.rfind(b"\n") + 1  # whole lines only
            seen += cut
            for line in new[:cut].decode(errors="replace").splitlines():
                if PROGRESS_EVENT in line:
                    progress(_progress_text(line))


def _progress_text(line: str) -> str:
    """`... chaos_progress ended=12 faults=3 requests=7200 t=90` -> `t=90 s: 12/7200 requests ended, 3
    faults fired`."""
    kv = dict(part.split("=", 1) for part in line.split() if "=" in part)
    return (
        f"t={kv.get('t', '?')} s: {kv.get('ended', '?')}/{kv.get('requests', '?')} requests ended, "
        f"{kv.get('faults', '?')} faults fired"
    )


def _env() -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("LUMEN_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env
