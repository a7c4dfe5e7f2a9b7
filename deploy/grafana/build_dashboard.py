"""The Lumen Grafana dashboard as code (issue 30), built with Grafana's own Python SDK
(`grafana-foundation-sdk`, a dev dependency): `python deploy/grafana/build_dashboard.py` writes
deploy/grafana/lumen-dashboard.json, which is checked in. Every panel queries metrics a gateway
exports at /metrics (tests/integration/test_grafana_dashboard.py checks the names, and that the JSON
is what this file builds). Import the JSON in Grafana with a Prometheus data source that scrapes the
gateways."""

from __future__ import annotations

import sys
from pathlib import Path

from grafana_foundation_sdk.builders.dashboard import Dashboard, Row
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.builders.stat import Panel as Stat
from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder

OUT = Path(__file__).with_name("lumen-dashboard.json")


def q(expr: str, legend: str = "") -> Dataquery:
    d = Dataquery().expr(expr)
    return d.legend_format(legend) if legend else d


def series(title: str, unit: str, *queries: Dataquery, description: str = "") -> Timeseries:
    p = Timeseries().title(title).unit(unit).height(8).span(8)
    if description:
        p = p.description(description)
    for query in queries:
        p = p.with_target(query)
    return p


def build() -> Dashboard:
    return (
        Dashboard("Lumen gateways")
        .uid("lumen-gateways")
        .tags(["lumen"])
        .refresh("30s")
        .time("now-30m", "now")
        .with_row(Row("Clients"))
        .with_panel(
            series(
                "Time to first token",
                "s",
                q("histogram_quantile(0.5, sum by (le) (rate(lumen_ttft_seconds_bucket[1m])))", "p50"),
                q("histogram_quantile(0.99, sum by (le) (rate(lumen_ttft_seconds_bucket[1m])))", "p99"),
            )
        )
        .with_panel(
            series(
                "Time per output token",
                "s",
                q("histogram_quantile(0.5, sum by (le) (rate(lumen_tpot_seconds_bucket[1m])))", "p50"),
                q("histogram_quantile(0.99, sum by (le) (rate(lumen_tpot_seconds_bucket[1m])))", "p99"),
            )
        )
        .with_panel(
            series(
                "Answers by status class",
                "reqps",
                q("sum by (outcome) (rate(lumen_requests_total[1m]))", "{{outcome}}"),
            )
        )
        .with_panel(
            series(
                "In flight and output tokens",
                "short",
                q("sum(lumen_inflight_requests)", "in flight"),
                q("sum(rate(lumen_output_tokens_total[1m]))", "output tokens/s"),
            )
        )
        .with_row(Row("Workers and recovery"))
        .with_panel(series("Workers by state", "short", q("sum by (state) (lumen_workers)", "{{state}}")))
        .with_panel(
            series(
                "Failures and interrupted requests",
                "short",
                q("sum by (reason) (increase(lumen_worker_failures_total[5m]))", "failed: {{reason}}"),
                q("sum(increase(lumen_interrupted_requests_total[5m]))", "interrupted"),
                q("sum by (kind) (increase(lumen_resumes_total[5m]))", "resumed: {{kind}}"),
            )
        )
        .with_panel(
            series(
                "Detection and resume delay (p99)",
                "s",
                q(
                    "histogram_quantile(0.99, sum by (le) (rate(lumen_failure_detection_seconds_bucket[5m])))",
                    "detection",
                ),
                q(
                    "histogram_quantile(0.99, sum by (le) (rate(lumen_resume_delay_seconds_bucket[5m])))",
                    "resume delay",
                ),
            )
        )
        .with_panel(
            series(
                "Stream resumes (Last-Event-ID)",
                "short",
                q("sum by (outcome) (increase(lumen_stream_resume_requests_total[5m]))", "{{outcome}}"),
            )
        )
        .with_panel(series("Outage batch boost", "short", q("max(lumen_outage_batch_boost)", "boost")))
        .with_row(Row("Checkpoints"))
        .with_panel(
            series(
                "Checkpoint coverage and holder balance",
                "short",
                q("min(lumen_checkpoint_coverage)", "coverage"),
                q("max(lumen_holder_balance)", "holder balance (max/min)"),
            )
        )
        .with_panel(
            series(
                "Tokens held and pages evicted",
                "short",
                q("sum by (worker) (lumen_checkpoint_tokens_held)", "held: {{worker}}"),
                q("sum by (worker) (delta(lumen_checkpoint_pages_evicted[5m]))", "evicted: {{worker}}"),
            )
        )
        .with_row(Row("Draft assist and configuration"))
        .with_panel(
            series(
                "Draft acceptance",
                "percentunit",
                q(
                    "sum(delta(lumen_accepted_draft_tokens[5m])) / sum(delta(lumen_drafted_tokens[5m]))",
                    "accepted",
                ),
            )
        )
        .with_panel(
            Stat()
            .title("Config generation and θ, τ")
            .height(8)
            .span(8)
            .with_target(q("max(lumen_config_generation)", "generation"))
            .with_target(
                q('max by (key) (lumen_config_value{key=~"recovery.theta|recovery.tau"})', "{{key}}")
            )
        )
    )


def render() -> str:
    return JSONEncoder(sort_keys=True, indent=2).encode(build().build()) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}", file=sys.stderr)
