"""A real Prometheus server (Debian's `prometheus`) scraping a live `lumen cluster up` with the alert rules
of deploy/prometheus/ (issue 30 item 3): a worker is killed -9, LumenWorkerFailed fires, and once the
supervisor has restarted the worker and its new incarnation attached, it resolves.

Scrapes and rule evaluations every 250 ms, so a FAILED state of about a second is seen. .ci/run installs
the package and sets LUMEN_REQUIRE_PROMTOOL=1 (then a missing binary fails the test); elsewhere the
test is skipped without it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from loadtests.cluster_proc import free_port

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "lumen-alerts.yml"


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        if os.environ.get("LUMEN_REQUIRE_PROMTOOL"):
            pytest.fail("prometheus is required here (LUMEN_REQUIRE_PROMTOOL): apt-get install prometheus")
        pytest.skip("prometheus not installed (Debian: apt-get install prometheus)")
    return found


@contextlib.contextmanager
def prometheus(target_port: int, tmp: Path) -> Iterator[str]:
    port = free_port()
    cfg = tmp / "prometheus.yml"
    cfg.write_text(
        json.dumps(  # JSON is YAML
            {
                "global": {"scrape_interval": "250ms", "evaluation_interval": "250ms"},
                "rule_files": [str(RULES)],
                "scrape_configs": [
                    {"job_name": "lumen", "static_configs": [{"targets": [f"127.0.0.1:{target_port}"]}]}
                ],
            }
        )
    )
    log = open(tmp / "prometheus.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [
            prometheus_binary(),
            f"--config.file={cfg}",
            f"--storage.tsdb.path={tmp / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def api(url: str, path: str) -> Any:
    with urllib.request.urlopen(url + path, timeout=5) as resp:
        return json.loads(resp.read())["data"]


def until(what: str, cond: Callable[[], bool], within: float) -> None:
    deadline = time.monotonic() + within
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within:g} s: {what}")
        time.sleep(0.1)


def alerts(url: str, name: str) -> list[dict[str, Any]]:
    try:
        return [a for a in api(url, "/api/v1/alerts")["alerts"] if a["labels"]["alertname"] == name]
    except OSError:
        return []


def test_a_killed_worker_fires_the_alert_and_it_resolves(cluster_factory: Any, tmp_path: Path) -> None:
    prometheus_binary()
    c = cluster_factory(workers=2)
    with prometheus(c.port, tmp_path) as prom:

        def scraped() -> bool:
            try:
                return any(t["health"] == "up" for t in api(prom, "/api/v1/targets")["activeTargets"])
            except OSError:
                return False

        until("Prometheus scrapes the gateway", scraped, 60)
        assert alerts(prom, "LumenWorkerFailed") == []
        kill = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "cluster", "kill", "--port", str(c.port), "w0"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert kill.returncode == 0, kill.stderr
        until(
            "LumenWorkerFailed fires",
            lambda: any(a["state"] == "firing" for a in alerts(prom, "LumenWorkerFailed")),
            30,
        )
        firing = alerts(prom, "LumenWorkerFailed")[0]
        assert firing["labels"]["severity"] == "warning" and firing["labels"]["job"] == "lumen"
        until("LumenWorkerFailed resolves (w0 back)", lambda: alerts(prom, "LumenWorkerFailed") == [], 60)
