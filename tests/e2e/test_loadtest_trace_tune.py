"""Issue 30's "done when", item 2, with real processes: `lumen loadtest` records its gateways' traffic
(`--set gateway.record_trace=PATH`), `lumen tune --trace PATH` recommends θ/τ beside today's values and
prints the command that applies it, and that command, run as printed, changes a running `lumen
cluster up` gateway live (its config generation and values)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from gateway.protocol.secrets import admin_key_for
from gateway.sim.workload import read_trace


def lumen(*args: str, timeout: float = 600) -> str:
    run = subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args], capture_output=True, text=True, timeout=timeout
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


def live_config(port: int) -> Any:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/admin/config")
    key = admin_key_for(port)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


@pytest.mark.slow  # two local clusters of the load test (~45 s) and one more
def test_a_loadtest_trace_feeds_tune_and_the_printed_command_applies_live(
    tmp_path: Path, cluster_factory: Any
) -> None:
    trace = tmp_path / "traffic.csv"
    lumen(
        "loadtest", "--modes", "lumen", "--workers", "2", "--duration", "6", "--rate", "4", "--kill-at", "2",
        "--model-load-s", "2", "--out", str(tmp_path / "lt"), "--set", f"gateway.record_trace={trace}",
    )  # fmt: skip
    w = read_trace(trace)
    assert len(w) >= 20  # both runs' requests (the no-failure twin and the failure run)
    c = cluster_factory(workers=2, mode="lumen")
    before = live_config(c.port)
    assert before["generation"] == 1
    out = lumen(
        "tune", "--scenario", "paper-4w", "--trace", str(trace), "--fail-at", "2", "--theta", "1.5,3",
        "--tau", "128,256", "--port", str(c.port), "--out", str(tmp_path / "tune"), "--no-plots", "--quiet",
    )  # fmt: skip
    assert "recommended" in out and "today" in out
    command = next(line for line in out.splitlines() if line.startswith("apply it live: "))
    argv = command.removeprefix("apply it live: ").split()
    assert argv[:4] == ["lumen", "cluster", "config", "set"]
    said = lumen(*argv[1:], timeout=60)
    theta, tau = float(argv[4].split("=")[1]), int(argv[5].split("=")[1])
    after = live_config(c.port)
    assert after["values"]["recovery.theta"] == theta and after["values"]["recovery.tau"] == tau
    changed = (theta, tau) != (before["values"]["recovery.theta"], before["values"]["recovery.tau"])
    assert after["generation"] == 1 + changed
    assert f"generation {after['generation']}" in said
