"""Prometheus metrics for one worker: SGLang's names for what SGLang also reports, `lumen_*` for the rest.

Values are read from the engine at scrape time by a collector registered in a per-worker registry
(no process-global metrics), so several in-process workers never mix their numbers.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.core.health import Phase
from worker_hooks.engine.engine import Engine


class EngineCollector(Collector):
    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self._engine
        s = engine.stats()
        labels = ["model_name"]
        model = [engine.spec.model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(model, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(model, value)
            return c

        yield gauge("sglang:num_running_reqs", "The number of running requests.", s.running)
        yield gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.", s.waiting)
        yield gauge("sglang:num_used_tokens", "The number of used KV tokens.", s.kv_tokens_used)
        yield gauge(
            "sglang:token_usage",
            "The token usage (KV tokens used / capacity).",
            s.kv_tokens_used / s.kv_capacity_tokens if s.kv_capacity_tokens else 0.0,
        )
        yield counter("sglang:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens_total)
        yield counter("sglang:generation_tokens", "Number of generation tokens.", s.generated_tokens_total)
        yield counter("sglang:num_requests", "Number of requests processed.", s.completed_total)

        yield counter("lumen_requests", "Requests accepted by this worker.", s.requests_total)
        yield counter("lumen_completed_requests", "Requests that finished normally.", s.completed_total)
        yield counter(
            "lumen_aborted_requests", "Requests aborted (abort, disconnect, reset).", s.aborted_total
        )
        yield counter("lumen_engine_steps", "Engine steps executed.", s.steps_total)
        yield gauge("lumen_kv_pages_used", "KV pages held by requests.", s.kv_pages_used)
        yield gauge("lumen_kv_capacity_tokens", "KV capacity of this worker in tokens.", s.kv_capacity_tokens)
        yield gauge(
            "lumen_incarnation", "This worker's incarnation (microseconds since the epoch).", s.incarnation
        )
        c = engine.ckpt.stats()
        yield gauge("lumen_ckpt_budget_bytes", "Checkpoint store budget (modelled bytes).", c.budget_bytes)
        yield gauge("lumen_ckpt_bytes_used", "Checkpoint store use (modelled bytes).", c.bytes_used)
        yield gauge("lumen_ckpt_tokens_held", "KV tokens held for other workers' requests.", c.tokens_held)
        yield gauge("lumen_ckpt_streaming_requests", "Requests whose pages are streamed.", c.streaming)
        yield counter("lumen_ckpt_bytes_sent", "KV bytes streamed to holders (modelled).", c.bytes_sent)
        yield counter("lumen_ckpt_pages_evicted", "Pages the store evicted for budget.", c.pages_evicted)
        yield counter("lumen_restores", "Requests admitted with a restored prefix.", c.restores)
        yield counter(
            "lumen_restored_tokens", "Prompt tokens restored instead of prefilled.", c.restored_tokens
        )
        t = engine.torch
        if t is not None:  # real step costs: what calibrates the cost model
            yield counter(
                "lumen_torch_forward_seconds", "Wall time of the model's forwards.", t.forward_s_total
            )
            yield counter(
                "lumen_torch_restore_seconds",
                "Wall time copying restored KV into the cache.",
                t.restore_s_total,
            )
            yield gauge("lumen_torch_load_seconds", "Wall time the full model took to load.", t.load_s)
            yield gauge(
                "lumen_torch_draft_load_seconds", "Wall time the draft model took to load.", t.draft_load_s
            )
        d = engine.assist.totals()
        yield counter(
            "lumen_draft_verified_tokens", "Drafts verified for this worker (as a target).", d.drafted
        )
        yield counter(
            "lumen_draft_accepted_tokens", "Drafts accepted by this worker's verification.", d.accepted
        )
        yield counter("lumen_draft_assisted_steps", "Engine steps that verified drafts.", d.rounds)
        seeding = engine.seeding
        yield counter(
            "lumen_seed_sends",
            "Weight transfers this worker served to a restarting peer.",
            seeding.sends_total,
        )
        yield gauge(
            "lumen_seed_sending",
            "Weight transfers this worker is serving now (its steps slower).",
            seeding.sending,
        )
        report = seeding.report
        yield gauge(
            "lumen_reload_seconds",
            "Modelled seconds this incarnation's restart took to serve (0: a first start).",
            report.seconds if report is not None else 0.0,
        )
        refused = CounterMetricFamily(
            "lumen_plane_refused",
            "Data-plane handshakes and messages refused: no CURVE or not a member (handshake), a key no "
            "longer a member's (unauthenticated), a header naming another worker (impersonated) or "
            "another incarnation (stale_epoch).",
            labels=["plane", "reason"],
        )
        for plane, counts in (
            ("kv", engine.ckpt.plane_refusals()),
            ("draft", engine.assist.plane_refusals()),
        ):
            for reason, n in counts.items():
                refused.add_metric([plane, reason], n)
        yield refused
        phase = GaugeMetricFamily("lumen_phase", "1 for the phase the worker is in.", labels=["phase"])
        for p in Phase:
            phase.add_metric([p.value], 1.0 if p is s.phase else 0.0)
        yield phase


def make_registry(engine: Engine) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine))
    return registry
