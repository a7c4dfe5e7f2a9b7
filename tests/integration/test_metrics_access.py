"""/metrics is open by default (Prometheus scrapers) and closed by gateway.metrics_public = false, where it
takes a client API key or the admin key (issue 29)."""

from __future__ import annotations

import aiohttp

from tests.integration.test_hostile_http import running_gateway

CLIENT = "client-key-for-metrics-0123"


async def status(url: str, key: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as http, http.get(url, headers=headers) as r:
        return r.status


async def test_metrics_open_by_default_and_closed_by_the_knob() -> None:
    async with running_gateway(**{"gateway.api_keys": [CLIENT]}) as gw:
        assert await status(f"http://127.0.0.1:{gw.http_port}/metrics") == 200
    async with running_gateway(**{"gateway.api_keys": [CLIENT], "gateway.metrics_public": False}) as gw:
        url = f"http://127.0.0.1:{gw.http_port}/metrics"
        assert await status(url) == 401
        assert await status(url, "wrong-key-0123456789") == 401
        assert await status(url, CLIENT) == 200
        assert await status(url, gw.config.gateway.admin_api_keys[0]) == 200
