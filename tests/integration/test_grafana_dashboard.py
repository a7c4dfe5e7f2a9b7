"""deploy/grafana/lumen-dashboard.json (issue 30): built as code by deploy/grafana/build_dashboard.py with
Grafana's own SDK (the checked-in JSON is what it builds), and every panel queries metrics a gateway
really exports (names checked against a gateway's metric registry, as /metrics serves them)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest

from gateway.config import load_config
from gateway.server.app import Gateway
from gateway.server.request_metrics import request_metrics_middleware
from tests.integration.test_prometheus_rules import exported_names

GRAFANA = Path(__file__).resolve().parents[2] / "deploy" / "grafana"


def exprs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return own + [e for v in node.values() for e in exprs(v)]
    if isinstance(node, list):
        return [e for v in node for e in exprs(v)]
    return []


def test_every_panel_queries_metrics_the_gateway_exports() -> None:
    board = json.loads((GRAFANA / "lumen-dashboard.json").read_text())
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert len(panels) >= 10 and all(exprs(p) for p in panels)  # no empty panel
    gw = Gateway(load_config(overrides={"gateway.port": 0, "gateway.control_port": 0}))
    request_metrics_middleware(gw.metrics)  # registered when the app is built, at start
    names = exported_names(gw)
    queried = {n for e in exprs(board) for n in re.findall(r"\blumen_[a-z_]+", e)}
    assert queried and queried <= names, sorted(queried - names)


def test_the_json_is_what_the_code_builds() -> None:
    if importlib.util.find_spec("grafana_foundation_sdk") is None:
        pytest.skip("grafana-foundation-sdk not installed (a dev dependency: pip install -e '.[dev]')")
    spec = importlib.util.spec_from_file_location("build_dashboard", GRAFANA / "build_dashboard.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.render() == (GRAFANA / "lumen-dashboard.json").read_text()
