"""`GET /openapi.json`: the client API as OpenAPI 3.1, derived from what the server runs.

The paths are the app's own routes (every one outside /admin), read from its router when first
asked; the request bodies are the msgspec types of gateway.protocol.openai.schema built from this
server's `Bounds` (its model name, token limits, vocabulary), turned into JSON Schema by msgspec;
every error is OpenAI's body (`ErrorResponse`). The routes add_client_routes registers carry the
bearer-key security (when keys are configured), the per-key 429 and their bodies' errors. OpenAPI
3.1's schemas are JSON Schema 2020-12, which msgspec writes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import hdrs, web

from gateway.protocol.openai.requests import Bounds
from gateway.protocol.openai.schema import ErrorResponse, request_bodies

OPENAPI_VERSION = "3.1.0"
REF = "#/components/schemas/{name}"

# what each error status means on the client routes (every one's body is ErrorResponse)
ERRORS: dict[int, str] = {
    400: "invalid request (the error names the parameter)",
    401: "missing or invalid API key",
    404: "unknown model or route",
    405: "method not allowed",
    408: "the request body did not arrive within limits.body_timeout_s",
    413: "request body over limits.max_request_bytes",
    429: "over a per-key or the gateway's concurrency or rate limit (see Retry-After)",
    502: "the serving worker failed and the request could not resume",
    503: "no healthy worker",
}
# which of them a client route may answer, by whether it takes a body (and generates)
_ROUTE_ERRORS = {
    True: (400, 401, 404, 405, 408, 413, 429, 502, 503),
    False: (401, 404, 405, 429),
}


@dataclass(frozen=True, slots=True)
class ClientRoute:
    """A client route as add_client_routes registers it: guarded by the API keys and limits."""

    method: str
    path: str  # canonical: /v1/models/{model}, whatever pattern the route gives {model}
    body: str | None = None  # the request body's name in schema.request_bodies; None: no body


def _error(status: int) -> dict[str, Any]:
    content = {"application/json": {"schema": {"$ref": REF.format(name="ErrorResponse")}}}
    resp: dict[str, Any] = {"description": ERRORS.get(status, "error"), "content": content}
    if status == 429:
        resp["headers"] = {
            "Retry-After": {"description": "seconds to wait", "schema": {"type": "integer", "minimum": 1}}
        }
    return resp


def _ok(generates: bool) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
    if generates:
        content["text/event-stream"] = {}  # SSE: `data: <chunk JSON>` events, then `data: [DONE]`
    why = "OK" + (" (an SSE stream when `stream` is true)" if generates else "")
    ok: dict[str, Any] = {"description": why, "content": content}
    if generates:  # docs/sglang.md, Determinism
        ok["headers"] = {
            "Lumen-Replay": {
                "description": "on a sampled request where a live server ignores `sampling_seed`: "
                '`not-reproducible; reason="..."` (the same seed, or a resume, may give other tokens)',
                "schema": {"type": "string"},
            }
        }
    return ok


def document(
    routes: Iterable[web.AbstractRoute],
    client: Mapping[tuple[str, str], ClientRoute],
    bounds: Bounds,
    *,
    title: str,
    version: str,
    keys: bool,
) -> dict[str, Any]:
    """The OpenAPI document of `routes` (the app's), `client` being the guarded client routes."""
    bodies = request_bodies(bounds)
    types = [t for alternatives in bodies.values() for t in alternatives]
    refs, components = msgspec.json.schema_components([*types, ErrorResponse], ref_template=REF)
    body_ref: dict[str, dict[str, Any]] = {}
    for name, alternatives in bodies.items():
        mine, refs = refs[: len(alternatives)], refs[len(alternatives) :]
        body_ref[name] = mine[0] if len(mine) == 1 else {"oneOf": list(mine)}
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        if route.resource is None or route.method == hdrs.METH_HEAD:
            continue
        path = route.resource.canonical
        if path.startswith("/admin"):
            continue
        c = client.get((route.method, path))
        doc_lines = (route.handler.__doc__ or "").strip().splitlines()
        op: dict[str, Any] = {
            "operationId": f"{route.method.lower()}{_op_name(path)}",
            "summary": doc_lines[0] if doc_lines else f"{route.method} {path}",
        }
        params = [p.strip("{}") for p in path.split("/") if p.startswith("{")]
        if params:
            op["parameters"] = [_path_param(p, bounds) for p in params]
        if c is None:  # /health, /metrics, this document: the gateway's own, open, no body
            op["responses"] = {"200": {"description": "OK"}, "default": {"description": "see the route"}}
        else:
            generates = c.body is not None
            responses = {"200": _ok(generates)}
            for status in _ROUTE_ERRORS[generates]:
                if status != 401 or keys:
                    responses[str(status)] = _error(status)
            op["responses"] = responses
            if c.body is not None:
                op["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": body_ref[c.body]}},
                }
            if keys:
                op["security"] = [{"bearer": []}]
        paths.setdefault(path, {})[route.method.lower()] = op
    doc: dict[str, Any] = {
        "openapi": OPENAPI_VERSION,
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": components},
    }
    if keys:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc


def _path_param(name: str, bounds: Bounds) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    if name == "model":  # /v1/models/{model}: the served model; any other is a 404
        schema["enum"] = [bounds.model]
    return {"name": name, "in": "path", "required": True, "schema": schema}


def _op_name(path: str) -> str:
    parts = [p.strip("{}").replace(".", "_").replace("-", "_") for p in path.split("/") if p]
    return "".join(p[:1].upper() + p[1:] for p in parts) or "Root"
