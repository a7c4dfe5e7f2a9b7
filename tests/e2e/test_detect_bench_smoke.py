"""scripts/detect_bench.py still runs end to end (one trial of each kind, a few seconds of no fault)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_detect_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "detect_bench.py"),
        "--trials",
        "1",
        "--minutes",
        "0.1",
        "--concurrency",
        "2",
        "--only",
        "kill:0,stop:0,false:load",
        "--json",
        str(out),
        "--png",
        str(tmp_path / "bench.png"),
        "--log-dir",
        str(tmp_path / "logs"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    assert set(runs) == {"kill:0", "stop:0", "false:load/0.1min"}
    assert runs["kill:0"]["trials"] == 1 and runs["stop:0"]["latencies_s"][0] > 0
    assert runs["false:load/0.1min"]["load"]["ok"] > 0
    assert (tmp_path / "bench.png").stat().st_size > 0
    assert "SIGSTOP → FAILED" in proc.stdout
