"""Policy knobs changed on a serving gateway (issue 30, gateway/server/live_config.py): θ and τ through
`POST /admin/config` and through SIGHUP (the config file re-read), under load; the dispatcher's next
decisions use the new values; a bad value, or a knob that cannot change while serving, is refused
whole and nothing changes; no stream breaks; /metrics and `GET /admin/config` show the generation."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp

from gateway.config import load_config
from gateway.core.dispatch import InterruptedRequest, dispatch
from gateway.server.app import Gateway
from tests.integration.test_gateway_inprocess import cluster

# Lumen's mode, checkpoints on (the holders' parameters are live too); θ absolute: a decision's reason
# shows θ itself (theta_eff = θ)
OVERRIDES: dict[str, Any] = {"recovery.mode": "lumen", "recovery.theta_mode": "absolute"}
TOML = """
[recovery]
mode = "lumen"
theta_mode = "absolute"
theta = {theta}
tau = {tau}

[gateway]
served_model_name = "{name}"
"""


def admin(gw: Gateway) -> dict[str, str]:
    keys = gw.config.gateway.admin_api_keys
    return {"Authorization": f"Bearer {keys[0]}"} if keys else {}


def decision_reason(gw: Gateway, durable: int) -> str:
    """What the running gateway's dispatcher decides for a request of w0 held on w1 (|C_r| = durable),
    with the parameters it reads at decision time."""
    assert gw.sessions is not None
    req = InterruptedRequest(
        "r", "w0", holders=("w1",), durable_tokens=durable, context_tokens=1000, remaining_tokens=100
    )
    return dispatch(gw.monitor.view(), req, gw.sessions.dispatcher.dispatch_params).reason


async def stream(http: aiohttp.ClientSession, i: int) -> str:
    body = {"prompt": f"live config {i}", "max_tokens": 400, "temperature": 0, "stream": True}
    async with http.post("/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        raw = await resp.read()
    assert raw.rstrip().endswith(b"data: [DONE]"), raw[-200:]  # the stream ended whole
    return raw.decode()


async def wait_for(cond: Any, within: float = 10.0) -> None:
    async with asyncio.timeout(within):
        while not cond():
            await asyncio.sleep(0.01)


async def post_config(http: aiohttp.ClientSession, gw: Gateway, changes: dict[str, Any]) -> tuple[int, Any]:
    async with http.post("/admin/config", json={"set": changes}, headers=admin(gw)) as resp:
        return resp.status, await resp.json()


async def test_theta_and_tau_change_live_under_load(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(TOML.format(theta=2.0, tau=512, name="lumen-synthetic"))
    async with cluster(3, **OVERRIDES) as (gw, _workers, http):
        gw.live.watch_sighup(lambda: load_config(path, {**OVERRIDES, "gateway.port": 0}))
        load = [asyncio.create_task(stream(http, i)) for i in range(12)]
        await wait_for(lambda: gw.sessions is not None and len(gw.sessions.live) >= 6)
        assert "tau=512" in decision_reason(gw, 600) and "theta_eff=2 " in decision_reason(gw, 100) + " "

        # POST /admin/config: both knobs at once, the answer names the new generation
        status, body = await post_config(http, gw, {"recovery.theta": 3.0, "recovery.tau": 256})
        assert status == 200, body
        assert body["generation"] == 2
        assert body["changed"] == {
            "recovery.theta": {"old": 2.0, "new": 3.0},
            "recovery.tau": {"old": 512, "new": 256},
        }
        assert "tau=256" in decision_reason(gw, 300)  # 300 > 256: resumes on its holder
        assert "theta_eff=3 " in decision_reason(gw, 200) + " "  # 200 <= 256: θ decides

        # refused whole: a bad value (the start-up message, naming the key), a knob that is not live
        status, body = await post_config(http, gw, {"recovery.tau": 64, "recovery.theta": -1.0})
        assert status == 400 and body["error"]["param"] == "recovery.theta", body
        assert "recovery.theta" in body["error"]["message"]
        status, body = await post_config(http, gw, {"gateway.port": 9999})
        assert (
            status == 400 and body["error"]["code"] == "not_live" and body["error"]["param"] == "gateway.port"
        )
        status, body = await post_config(http, gw, {"recovery.nonsense": 1})
        assert status == 400 and body["error"]["param"] == "recovery.nonsense"
        assert gw.live.generation == 2 and gw.config.recovery.tau == 256 and gw.config.recovery.theta == 3.0
        assert "tau=256" in decision_reason(gw, 300)

        # SIGHUP: the file re-read, its live knobs applied
        path.write_text(TOML.format(theta=0.01, tau=128, name="lumen-synthetic"))
        os.kill(os.getpid(), signal.SIGHUP)
        await wait_for(lambda: gw.live.generation == 3)
        assert gw.config.recovery.theta == 0.01 and gw.config.recovery.tau == 128
        assert gw.live.changes[-1].source == "sighup"
        assert "tau=128" in decision_reason(gw, 200)
        assert "theta_eff=0.01" in decision_reason(gw, 100)
        # a file that changes a knob that is not live: refused whole, nothing changes
        path.write_text(TOML.format(theta=5.0, tau=64, name="renamed"))
        os.kill(os.getpid(), signal.SIGHUP)
        await asyncio.sleep(0)  # the handler runs on the loop's next turn
        await asyncio.sleep(0.05)
        assert gw.live.generation == 3 and gw.config.recovery.tau == 128

        texts = await asyncio.gather(*load)  # every stream whole
        assert len(texts) == 12
        async with http.get("/admin/config", headers=admin(gw)) as resp:
            shown = await resp.json()
        assert shown["generation"] == 3 and shown["values"]["recovery.tau"] == 128
        assert [c["source"] for c in shown["changes"]] == ["admin", "sighup"]
        async with http.get("/metrics") as resp:
            metrics = await resp.text()
        assert "lumen_config_generation 3.0" in metrics
        assert 'lumen_config_value{key="recovery.tau"} 128.0' in metrics
        assert 'lumen_config_value{key="recovery.theta"} 0.01' in metrics


async def test_limits_and_levers_change_live() -> None:
    async with cluster(1, **OVERRIDES) as (gw, _workers, http):
        status, body = await post_config(
            http,
            gw,
            {
                "limits.max_new_tokens": 16,
                "limits.default_max_tokens": 8,
                "load.alpha": 0.5,
                "health.phi_fail": 9.0,
            },
        )
        assert status == 200, body
        body = {"prompt": "x", "max_tokens": 17}
        async with http.post("/v1/completions", json=body) as resp:  # the new bound, at once
            assert resp.status == 400 and (await resp.json())["error"]["param"] == "max_tokens"
        assert gw.sessions is not None and gw.sessions.dispatcher.dispatch_params.load.alpha == 0.5
        assert gw.checkpoints is not None and gw.checkpoints.params.load.alpha == 0.5
        assert gw.monitor.detection.params.phi_fail == 9.0
        assert all(
            w.detector is None or w.detector.params.phi_fail == 9.0 for w in gw.monitor.workers.values()
        )
        status, body = await post_config(http, gw, {"limits.max_new_tokens": 16})
        assert status == 200 and body["changed"] == {} and body["generation"] == 2  # nothing differs


def ours(out: str) -> list[str]:
    """The command's own lines (the gateways' logs share the test's stdout)."""
    return [line for line in out.splitlines() if line.startswith("gateway :")]


async def test_cluster_config_set_applies_to_every_gateway(capsys: Any) -> None:
    """`lumen cluster config set` on two gateways: each one's generation reported; a refusal too."""
    from gateway.cli.admin import cmd_cluster_config_set, cmd_cluster_status

    async with cluster(1, **OVERRIDES) as (gw0, _w0, _h0), cluster(1, **OVERRIDES) as (gw1, _w1, _h1):
        ports = [gw0.http_port, gw1.http_port]
        args = argparse.Namespace(
            assignments=["recovery.theta=3.5", "recovery.tau=100"], port=ports, gateways=1
        )
        assert await asyncio.to_thread(cmd_cluster_config_set, args) == 0
        out = ours(capsys.readouterr().out)
        assert out == [
            f"gateway :{p}  generation 2  recovery.theta: 2.0 -> 3.5, recovery.tau: 512 -> 100" for p in ports
        ]
        assert gw0.config.recovery.tau == gw1.config.recovery.tau == 100
        bad = argparse.Namespace(assignments=["recovery.tau=-5"], port=ports, gateways=1)
        assert await asyncio.to_thread(cmd_cluster_config_set, bad) == 1
        out = ours(capsys.readouterr().out)
        assert len(out) == 2 and all("refused" in line and "recovery.tau" in line for line in out)
        assert await asyncio.to_thread(cmd_cluster_status, argparse.Namespace(port=ports[0])) == 0
        status = capsys.readouterr().out
        assert "config generation 2: recovery.theta=3.5 recovery.tau=100" in status


async def test_per_key_limits_change_live_where_they_were_on() -> None:
    async with cluster(1, **OVERRIDES, **{"limits.per_key_rate_per_s": 1000.0}) as (gw, _workers, http):
        status, body = await post_config(http, gw, {"limits.per_key_max_concurrent": 1})
        assert status == 200, body
        slow = {"prompt": "hold", "max_tokens": 300, "stream": True}
        async with http.post("/v1/completions", json=slow) as first:  # one in flight for this client
            assert first.status == 200
            async with http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}) as second:
                assert second.status == 429  # the new limit, at once
            await first.read()
    async with cluster(1, **OVERRIDES) as (gw, _workers, http):  # off at start: cannot be turned on
        status, body = await post_config(http, gw, {"limits.per_key_rate_per_s": 5.0})
        assert status == 400 and body["error"]["param"] == "limits.per_key_rate_per_s", body
        assert gw.live.generation == 1
