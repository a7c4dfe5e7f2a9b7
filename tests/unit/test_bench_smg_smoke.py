"""The gateway-overhead bench (loadtests/bench_smg): its report with Lumen measured on one and on two
gateway processes (`--lumen-gateways 1,2`), and (slow) a tiny end-to-end run of both variants."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loadtests import bench_smg
from loadtests.bench_smg.measure import gateway_counts, lumen_names
from loadtests.bench_smg.plots import plot_rates
from loadtests.bench_smg.report import label, tables


def _row(rate: float, achieved: float, p99: float | None, errors: int = 0) -> dict[str, Any]:
    return {
        "rate": rate, "requests": 10, "ok": 10 - errors, "errors": errors, "error_examples": [],
        "ttft_p50_ms": 2.0, "ttft_p99_ms": p99, "tpot_p50_ms": 0.8, "tpot_p99_ms": 0.9,
        "offered_rps": rate, "achieved_rps": achieved, "send_lag_p99_ms": 0.1,
    }  # fmt: skip


def _report() -> dict[str, Any]:
    rows = {
        "direct@80": _row(80, 80, 5), "direct@160": _row(160, 159, 8),
        "lumen@80": _row(80, 79, 40), "lumen@160": _row(160, 120, 7000),
        "lumen_x2@80": _row(80, 80, 10), "lumen_x2@160": _row(160, 158, 60),
        "smg@80": _row(80, 80, 4), "smg@160": _row(160, 160, 9),
    }  # fmt: skip
    return {
        "command": "python -m loadtests.bench_smg --lumen-gateways 1,2",
        "machine": "test",
        "loadavg_at_start": [0.1, 0.2, 0.3],
        "date": "today",
        "commit": "abc",
        "args": {"rates": "80,160", "ttft_bound_ms": 100.0},
        "smg": {"version_or_reason": "1.13.0", "measured": ["smg"]},
        "lumen_clusters": {"1": {}, "2": {}},
        "rows": rows,
        "targets": [
            {"name": n, "kind": "k", "baseline": "direct"} for n in ("direct", "lumen", "lumen_x2", "smg")
        ],
        "max_sustained_rps": {"direct": 160.0, "lumen": 80.0, "lumen_x2": 160.0, "smg": 160.0},
    }


def test_gateway_counts_and_names() -> None:
    assert gateway_counts("1,2,2") == [1, 2]
    assert gateway_counts("2") == [2]
    with pytest.raises(ValueError):
        gateway_counts("0")
    assert lumen_names(1) == ("lumen", "lumen_gen")
    assert lumen_names(2) == ("lumen_x2", "lumen_gen_x2")
    report = _report()
    assert label("lumen", report) == "lumen x1"
    assert label("lumen_gen_x2", report) == "lumen_gen x2 (shared port)"
    assert label("smg", report) == "smg"
    assert label("lumen", {}) == "lumen"  # one gateway count only: the names of before


def test_tables_show_every_variant_and_the_goal(tmp_path: Path) -> None:
    report = _report()
    md = tables(report)
    assert "| lumen x1 | 79.0 · 40 ✓ | 120.0 · 7000 | 80 |" in md
    assert "| lumen x2 (shared port) | 80.0 · 10 ✓ | 158.0 · 60 ✓ | 160 |" in md
    assert "- lumen x2 (shared port): met (160 ≥ 160 req/s)" in md
    assert "SMG sustained the top of the ladder (160 req/s)" in md
    report["rows"]["lumen_x2@160"] = _row(160, 158, 60, errors=1)
    report["max_sustained_rps"]["lumen_x2"] = 80.0
    assert "- lumen x2 (shared port): NOT met (80 < 160 req/s)" in tables(report)
    pytest.importorskip("matplotlib")
    assert plot_rates(report, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000


@pytest.mark.slow  # starts two Lumen clusters (1 and 2 gateway processes): ~40 s on a busy 2-core machine
def test_bench_smg_measures_one_and_two_gateways(tmp_path: Path) -> None:
    out = tmp_path / "b.json"
    args = ["--lumen-gateways", "1,2", "--no-smg", "--no-lumen-generate", "--rates", "10"]
    args += ["--seconds", "1", "--min-requests", "8", "--repeats", "1", "--out", str(out)]
    assert bench_smg.main(args) == 0
    report = json.loads(out.read_text())
    assert set(report["rows"]) == {"direct@10", "direct_oai@10", "lumen@10", "lumen_x2@10"}
    for key, row in report["rows"].items():
        assert row["errors"] == 0, (key, row["error_examples"])
        assert row["ok"] == row["requests"] == 10  # max(--min-requests, rate x seconds)
    assert len(report["lumen_clusters"]["2"]["gateway_pids"]) == 2
    assert set(report["rows"]["lumen_x2@10"]["gateway_cpu_split"]) == {"lumen_x2/g0", "lumen_x2/g1"}
    assert "lumen x2 (shared port)" in out.with_suffix(".md").read_text()
