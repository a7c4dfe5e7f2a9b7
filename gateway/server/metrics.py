"""Prometheus metrics of one gateway, in its own registry (no process globals)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "lumen_requests", "Client requests by endpoint and outcome", ["endpoint", "outcome"], registry=r
        )
        self.inflight = Gauge("lumen_inflight_requests", "Requests in flight in the gateway", registry=r)
        self.ttft = Histogram(
            "lumen_ttft_seconds",
            "Time to first token seen by the gateway",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.output_tokens = Counter("lumen_output_tokens", "Output tokens streamed to clients", registry=r)
        self.worker_failures = Counter(
            "lumen_worker_failures", "Worker incarnations declared FAILED", ["reason"], registry=r
        )
        self.detection_seconds = Histogram(
            "lumen_failure_detection_seconds",
            "Last heartbeat to FAILED",
            buckets=(0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.2, 0.5, 1, 5),
            registry=r,
        )
        self.interrupted = Counter(
            "lumen_interrupted_requests", "Requests whose worker failed mid-flight", ["mode"], registry=r
        )
        self.resumes = Counter("lumen_resumes", "Resumed attempts by how they resumed", ["kind"], registry=r)
        self.stream_resumes = Counter(
            "lumen_stream_resumes",
            "Client streams resumed here with Last-Event-ID, by how (adopt: taken over on its worker; "
            "replay: recomputed with the same seed)",
            ["how"],
            registry=r,
        )
        self.resume_delay = Histogram(
            "lumen_resume_delay_seconds",
            "Gap between the last token before a failure and the first after it",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.stalls = Counter(
            "lumen_stream_stalls", "Worker streams abandoned after a stall timeout", registry=r
        )
        self.client_errors = Counter(
            "lumen_client_visible_errors",
            "Requests that ended in an error for the client",
            ["code"],
            registry=r,
        )
        self.ckpt_assignments = Counter(
            "lumen_checkpoint_assignments",
            "Checkpoint holder assignments by outcome",
            ["outcome"],
            registry=r,
        )
        self.ckpt_coverage = Gauge(
            "lumen_checkpoint_coverage", "Share of in-flight attempts with a live checkpoint", registry=r
        )
        self.holder_balance = Gauge(
            "lumen_holder_balance",
            "max/min checkpointed tokens across HEALTHY holders (1 = even)",
            registry=r,
        )
        self.ckpt_tokens_held = Gauge(
            "lumen_checkpoint_tokens_held", "Checkpointed tokens held per worker", ["worker"], registry=r
        )
        self.ckpt_bytes_streamed = Gauge(
            "lumen_checkpoint_bytes_streamed",
            "Modelled KV bytes streamed to holders, per serving worker (since start)",
            ["worker"],
            registry=r,
        )
        self.ckpt_pages_evicted = Gauge(
            "lumen_checkpoint_pages_evicted", "Pages evicted by holders' budgets", ["worker"], registry=r
        )
        self.restored_tokens = Counter(
            "lumen_restored_tokens",
            "Prompt tokens restored from checkpoints instead of recomputed",
            registry=r,
        )
        self.assist_pairs = Gauge("lumen_draft_assist_pairs", "Drafter-target pairs in force", registry=r)
        self.outage_boost = Gauge(
            "lumen_outage_batch_boost",
            "Batch-limit factor granted to the serving workers while a recovery lasts (1: none)",
            registry=r,
        )
        self.held_waiting = Gauge(
            "lumen_sglang_held_waiting",
            "Requests waiting at the gateway for a slot of an SGLang server it holds to its batch",
            ["worker"],
            registry=r,
        )
        self.held_limit = Gauge(
            "lumen_sglang_held_limit",
            "The batch the gateway holds an SGLang server to now (boosted while a recovery lasts)",
            ["worker"],
            registry=r,
        )
        self.assist_changes = Counter(
            "lumen_draft_assist_changes", "Draft-assist pairs started and stopped", ["change"], registry=r
        )
        self.drafted_tokens = Gauge(
            "lumen_drafted_tokens",
            "Draft tokens verified by each target (since start)",
            ["worker"],
            registry=r,
        )
        self.accepted_tokens = Gauge(
            "lumen_accepted_draft_tokens", "Draft tokens accepted by each target", ["worker"], registry=r
        )
        self.draft_rounds = Gauge(
            "lumen_draft_rounds", "Draft-assisted target steps per worker", ["worker"], registry=r
        )
        self.gateway_drafts = Counter(
            "lumen_gateway_verified_drafts",
            "Draft tokens the gateway verified on SGLang targets, proposed and accepted",
            ["target", "outcome"],
            registry=r,
        )
        self.reload_seconds = Histogram(
            "lumen_reload_seconds",
            "A restarted server's reload, from its exit to ready, by where its weights came from",
            ["source"],
            buckets=(0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600),
            registry=r,
        )
        self.reload_seeds = Counter(
            "lumen_reload_seed_choices",
            "Restarting servers offered a seed to reload from, or none (they load from storage)",
            ["outcome"],
            registry=r,
        )
        self.worker_refusals = Counter(
            "lumen_worker_refusals",
            "Error statuses workers answered a request with: client_error (the request's own fault, "
            "answered to the client as a 4xx) or retried (the worker's own: another worker)",
            ["status", "outcome"],
            registry=r,
        )
        self.draft_refusals = Counter(
            "lumen_gateway_draft_refusals",
            "Verification calls an SGLang target refused for their drafts (the stream went on plainly "
            "and the drafter was dropped for that target)",
            ["target"],
            registry=r,
        )
        self.nonexact_resumes = Counter(
            "lumen_nonexact_resumes",
            "Resumes moving a request off or onto a server that does not promise bit-equal logits "
            "(docs/sglang.md, Determinism): still exactly the tokens the client has, no duplicate and "
            "no gap, but the continuation may differ from an uninterrupted run",
            ["side"],
            registry=r,
        )
        self.workers = Gauge("lumen_workers", "Workers by state", ["state"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
