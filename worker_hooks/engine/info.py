"""Discovery, load and metrics endpoints, shaped like SGLang's so an SGLang gateway can use the worker.

Field sets follow what SGLang returns and what SMG (lightseekorg/smg) parses:
- `/v1/models` with `owned_by: "sglang"` (SMG's primary backend detection);
- `/model_info` and `/server_info` (and the deprecated `/get_*` aliases) with SMG's optional fields;
  `/server_info` never carries both `model` and `model_id` (SMG treats them as aliases);
- `/v1/loads` as SGLang's `{timestamp, version, dp_rank_count, loads: [...], aggregate}`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from importlib import metadata

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from worker_hooks.engine.http import WORKER, json_response

try:
    VERSION = metadata.version("lumen")
except metadata.PackageNotFoundError:  # running from a source tree without an install
    VERSION = "0.0.0"


async def model_info(request: web.Request) -> web.Response:
    w = request.app[WORKER]
    return json_response(
        {
            "model_path": w.spec.model,
            "tokenizer_path": w.spec.model,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "lumen": {"backend": w.spec.backend, "vocab_size": w.spec.vocab_size},
        }
    )


async def server_info(request: web.Request) -> web.Response:
    w = request.app[WORKER]
    spec, s = w.spec, w.engine.stats()
    return json_response(
        {
            "model_path": spec.model,
            "tokenizer_path": spec.model,
            "served_model_name": spec.model,
            "host": spec.host,
            "port": w.port,
            "tp_size": w.engine.cost.tp,
            "dp_size": 1,
            "pp_size": 1,
            "load_balance_method": "round_robin",
            "disaggregation_mode": "null",
            "page_size": spec.page_size,
            "chunked_prefill_size": spec.chunked_prefill_size,
            "max_prefill_tokens": spec.chunked_prefill_size,
            "max_running_requests": spec.max_running_requests,
            "max_total_num_tokens": s.kv_capacity_tokens,
            "max_total_tokens": s.kv_capacity_tokens,
            "version": VERSION,
            "internal_states": [{"last_gen_throughput": 0.0}],
            "lumen": {
                "worker_id": w.engine.worker_id,
                "incarnation": s.incarnation,
                "phase": s.phase.value,
                "backend": spec.backend,
                "gpu": spec.gpu,
                "time_scale": spec.time_scale,
            },
        }
    )


async def models(request: web.Request) -> web.Response:
    w = request.app[WORKER]
    card = {
        "id": w.spec.model,
        "object": "model",
        "created": w.started_at,
        "owned_by": "sglang",
        "root": w.spec.model,
        "max_model_len": w.engine.pool.capacity_tokens,
    }
    return json_response({"object": "list", "data": [card]})


async def version(request: web.Request) -> web.Response:
    return json_response({"version": VERSION})


async def loads(request: web.Request) -> web.Response:
    w = request.app[WORKER]
    s = w.engine.stats()
    usage = round(s.kv_tokens_used / s.kv_capacity_tokens, 4) if s.kv_capacity_tokens else 0.0
    load = {
        "dp_rank": 0,
        "num_running_reqs": s.running,
        "num_waiting_reqs": s.waiting,
        "num_used_tokens": s.kv_tokens_used,
        "num_total_tokens": s.kv_tokens_used,
        "max_total_num_tokens": s.kv_capacity_tokens,
        "token_usage": usage,
        "gen_throughput": 0.0,
        "cache_hit_rate": 0.0,
        "utilization": round(s.running / s.max_running_requests, 4),
        "max_running_requests": s.max_running_requests,
        "num_total_reqs": s.running + s.waiting,
    }
    return json_response(
        {
            "timestamp": datetime.now(UTC).isoformat(),
            "version": VERSION,
            "dp_rank_count": 1,
            "loads": [load],
            "aggregate": {
                "total_running_reqs": s.running,
                "total_waiting_reqs": s.waiting,
                "total_reqs": s.running + s.waiting,
                "avg_token_usage": usage,
                "avg_throughput": 0.0,
                "avg_utilization": load["utilization"],
            },
        }
    )


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[WORKER].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def add_routes(app: web.Application) -> None:
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, model_info)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/version", version)
    app.router.add_get("/v1/loads", loads)
    app.router.add_get("/metrics", metrics)
