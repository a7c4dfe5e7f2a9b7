"""deploy/prometheus/ (issue 30): the recording and alert rules pass `promtool check rules` and their unit
tests (`promtool test rules deploy/prometheus/tests/*.yml`: each alert fires on the series that should
raise it and resolves after, each recording rule's value on known series); every metric they query is
one a gateway exports; and a live gateway counts its answers by status class and its stream resumes
by outcome (the series the 5xx and resume alerts read).

promtool comes with Debian's `prometheus` package; .ci/run installs it and sets LUMEN_REQUIRE_PROMTOOL=1,
so CI fails rather than skips without it. Elsewhere the promtool tests are skipped when it is absent."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from gateway.config import load_config
from gateway.protocol.streamid import RESUMABLE_HEADER
from gateway.server.app import Gateway
from gateway.server.request_metrics import request_metrics_middleware
from tests.integration.test_gateway_inprocess import cluster

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"
RULE_FILES = sorted(RULES.glob("lumen-*.yml"))
TEST_FILES = sorted((RULES / "tests").glob("*.yml"))


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("LUMEN_REQUIRE_PROMTOOL"):
            pytest.fail("promtool is required here (LUMEN_REQUIRE_PROMTOOL): apt-get install prometheus")
        pytest.skip("promtool not installed (Debian: apt-get install prometheus)")
    return found


def test_promtool_checks_and_unit_tests_pass() -> None:
    tool = promtool()
    assert len(RULE_FILES) == 2 and TEST_FILES
    check = subprocess.run([tool, "check", "rules", *map(str, RULE_FILES)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    run = subprocess.run([tool, "test", "rules", *map(str, TEST_FILES)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("SUCCESS") == len(TEST_FILES)


def test_a_wrong_expectation_fails(tmp_path: Path) -> None:
    """The unit tests can fail: one expected value changed is reported."""
    tool = promtool()
    src = (RULES / "tests" / "recording_test.yml").read_text()
    bad = tmp_path / "bad.yml"
    bad.write_text(src.replace("value: 0.95", "value: 0.9").replace("../lumen-", f"{RULES}/lumen-"))
    run = subprocess.run([tool, "test", "rules", str(bad)], capture_output=True, text=True)
    assert run.returncode != 0 and "9.5E-01" in run.stdout + run.stderr


def exported_names(gw: Gateway) -> set[str]:
    """Every series name a gateway's /metrics can carry (counters' _total, histograms' _bucket ...)."""
    names: set[str] = set()
    for family in gw.metrics.registry.collect():
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(
            family.type, ("",)
        )
        names.update(family.name + s for s in suffixes)
    return names


def test_every_metric_the_rules_query_is_exported() -> None:
    gw = Gateway(load_config(overrides={"gateway.port": 0, "gateway.control_port": 0}))
    request_metrics_middleware(gw.metrics)  # registered when the app is built, at start
    names = exported_names(gw)
    queried = {n for f in RULE_FILES for n in re.findall(r"\blumen_[a-z_]+", f.read_text())}
    assert queried and queried <= names, sorted(queried - names)


async def test_answers_and_resumes_are_counted() -> None:
    async with cluster(1) as (_gw, _workers, http):
        body = {"prompt": "count me", "max_tokens": 4, "stream": True}
        async with http.post("/v1/completions", json=body) as resp:
            assert resp.status == 200
            await resp.read()
        async with http.post("/v1/completions", json={"prompt": "x", "max_tokens": -1}) as resp:
            assert resp.status == 400
        headers = {"Last-Event-ID": "forged", RESUMABLE_HEADER: "1"}
        async with http.post("/v1/completions", json=body, headers=headers) as resp:
            assert resp.status == 400
        async with http.get("/metrics") as resp:
            text = await resp.text()
    assert 'lumen_requests_total{endpoint="/v1/completions",outcome="2xx"} 1.0' in text
    assert 'lumen_requests_total{endpoint="/v1/completions",outcome="4xx"} 2.0' in text
    assert 'lumen_stream_resume_requests_total{outcome="refused"} 1.0' in text
    assert 'lumen_stream_resume_requests_total{outcome="failed"} 0.0' in text
    assert "lumen_tpot_seconds_count 1.0" in text  # the one stream's time per token (4 tokens)
