"""The GPU benchmark script (scripts/bench_torch.py) runs end to end on CPU with tiny presets and
writes every table the cost model's calibration needs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a benchmark in a subprocess; the APIs it times are tested in test_torch_model.py
def test_bench_torch_quick_writes_every_measurement(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_torch.py"), "--device", "cpu", "--quick"]
    proc = subprocess.run(
        [*cmd, "--out", str(tmp_path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((tmp_path / "results.json").read_text())
    assert {"restore_vs_recompute", "decode", "verify", "load", "draft_decode", "derived"} <= set(res)
    for row in res["restore_vs_recompute"]:
        assert row["restore_ms"] > 0 and row["recompute_ms"] > 0
    assert [r["k"] for r in res["verify"]] == [0, 1, 2]
    d = res["derived"]
    assert d["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 2  # tiny: 2 layers x K,V x 2 kv heads x 16 x bf16
    assert d["prefill_tok_s"] > 0 and d["restore_h2d_gb_s"] > 0 and d["load_gb_s_warm"] > 0
    assert "| context |" in (tmp_path / "results.md").read_text()
