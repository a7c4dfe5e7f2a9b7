"""SGLang servers started with `--api-key` behind the gateway (issue 30): each server's key is sent on
every request the gateway makes to it — agentless from `[[sglang.workers]]` (`api_key`,
`api_key_file`, or LUMEN_SGLANG_API_KEY), behind the agent from its Hello — and the agent launches a
server with a key it generated when none was given, through a 0600 `--config` file, never on the
server's command line (worker_hooks/sglang/server_key.py, gateway/server/workers/server_keys.py)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.config import ConfigError, load_config
from gateway.server.app import Gateway
from tests.fixtures.sglang_standin import start_standin
from tests.integration.test_sglang_agent import gateway, sidecar, standin
from tests.integration.test_sglang_gateway import sglang_cluster, wait_until
from worker_hooks.sglang.launcher import LaunchError
from worker_hooks.sglang.server_key import given_key, launch_key

KEY_A = "sk-sglang-server-a-0123456789"
KEY_B = "sk-sglang-server-b-9876543210"


async def complete(http: aiohttp.ClientSession, path: str, body: dict[str, Any]) -> dict[str, Any]:
    async with http.post(path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return dict(await resp.json())


async def streamed(http: aiohttp.ClientSession) -> list[Any]:
    body = {"prompt": "keys", "max_tokens": 12, "temperature": 0, "stream": True}
    async with http.post("/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        lines = [ln.strip() for ln in (await resp.read()).split(b"\n") if ln.strip()]
    return [ln for ln in lines if ln != b"data: [DONE]"]


async def test_agentless_servers_get_their_own_keys(tmp_path: Path) -> None:
    a = await start_standin(token_delay_ms=2, api_key=KEY_A)
    b = await start_standin(token_delay_ms=2, api_key=KEY_B)
    key_file = tmp_path / "b.key"
    key_file.write_text(KEY_B + "\n")
    key_file.chmod(0o600)
    workers = [
        {"url": a.url, "id": "a", "api_key": KEY_A},
        {"url": b.url, "id": "b", "api_key_file": str(key_file)},
    ]
    try:
        # the servers do refuse requests without a key
        async with aiohttp.ClientSession() as direct, direct.get(a.url + "/v1/loads") as resp:
            assert resp.status == 401
        cfg = load_config(
            overrides={
                "gateway.port": 0,
                "gateway.control_port": 0,
                "timeouts.control_stop_grace_s": 0.05,
                "sglang.poll_interval_ms": 20,
                "sglang.workers": workers,
            }
        )
        assert KEY_A not in repr(cfg)
        gw = Gateway(cfg)
        await gw.start()
        try:
            await wait_until(lambda: gw.monitor.healthy_count() == 2, 10.0)
            async with aiohttp.ClientSession(f"http://127.0.0.1:{gw.http_port}") as http:
                for _ in range(4):  # both servers serve (routed by load)
                    assert await streamed(http)
                    out = await complete(
                        http, "/generate", {"text": "k", "sampling_params": {"max_new_tokens": 4}}
                    )
                    assert out["meta_info"]["completion_tokens"] == 4
        finally:
            await gw.stop()
        assert a.unauthorized == 1 and b.unauthorized == 0  # only the test's own keyless request
    finally:
        await a.stop()
        await b.stop()


async def test_without_its_key_a_server_never_attaches() -> None:
    s = await start_standin(token_delay_ms=2, api_key=KEY_A)
    try:
        async with sglang_cluster(0, **{"sglang.workers": [{"url": s.url, "id": "a"}]}) as (
            gw,
            _servers,
            _http,
        ):
            await wait_until(lambda: s.unauthorized >= 3, 10.0)  # its polls refused: 401
            assert gw.monitor.healthy_count() == 0
    finally:
        await s.stop()


def test_keys_from_the_environment_and_config_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LUMEN_SGLANG_API_KEY", KEY_B)
    cfg = load_config(
        overrides={
            "sglang.workers": [{"url": "http://h1:30000"}, {"url": "http://h2:30000", "api_key": KEY_A}]
        }
    )
    assert [w.api_key for w in cfg.sglang.workers] == [KEY_B, KEY_A]  # the entry's own key wins
    monkeypatch.delenv("LUMEN_SGLANG_API_KEY")
    with pytest.raises(ConfigError, match=r"sglang\.workers\[0\]\.api_key_file"):
        load_config(
            overrides={"sglang.workers": [{"url": "http://h:1", "api_key_file": str(tmp_path / "none")}]}
        )
    with pytest.raises(ConfigError, match=r"sglang\.workers\[0\]\.api_key_file"):
        load_config(
            overrides={"sglang.workers": [{"url": "http://h:1", "api_key": KEY_A, "api_key_file": "x"}]}
        )


async def test_behind_the_agent_the_gateway_uses_the_key_from_hello() -> None:
    async with standin(token_delay_ms=2, api_key=KEY_A) as s, gateway() as gw:
        async with sidecar([gw], s.url, "s0", api_key=KEY_A):
            await wait_until(lambda: gw.monitor.healthy_count() == 1, 10.0)
            async with aiohttp.ClientSession(f"http://127.0.0.1:{gw.http_port}") as http:
                assert await streamed(http)
        assert s.unauthorized == 0


def test_the_agent_generates_a_key_in_a_private_config_file(monkeypatch: pytest.MonkeyPatch) -> None:
    tail, key = launch_key(["--model-path", "m"], "")
    assert len(key) >= 32 and key not in " ".join(tail)  # never on the command line
    path = Path(tail[tail.index("--config") + 1])
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert path.read_text().startswith("api-key: ") and json.loads(path.read_text().partition(":")[2]) == key
    # a key given: in the launch arguments (kept there, the user's own command line), or from outside
    assert launch_key(["--api-key", KEY_A], "") == (["--api-key", KEY_A], KEY_A)
    tail, key = launch_key([], KEY_B)
    assert key == KEY_B and KEY_B not in tail
    assert launch_key(["--config", "mine.yaml"], "") == (["--config", "mine.yaml"], "")  # theirs kept
    monkeypatch.setenv("LUMEN_SGLANG_API_KEY", KEY_A)
    assert given_key(None, os.environ) == KEY_A
    with pytest.raises(LaunchError, match="api-key-file"):
        given_key("/nonexistent/key", os.environ)
