"""Determinism said, not assumed (issue 27): the gateway reads each SGLang server's numerics from its
/server_info, shows the judgement in /admin/workers and `lumen cluster status`, counts resumes off or
onto servers that do not promise bit-equal logits (metric and log line), and answers a sampled request
served where `sampling_seed` is ignored with `Lumen-Replay: not-reproducible` (the body stays OpenAI's).
Stand-ins answer /server_info as a real server would: float32 on CPU (SGLang's CPU numerics), or
deterministic inference with flashinfer (a GPU server launched for exactness)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web

from gateway.cli import admin as cli_admin
from gateway.core.health import WorkerState
from tests.fixtures.sglang_standin import SGLangStandIn, expected_ids
from tests.integration.test_sglang_gateway import sglang_cluster, stream_ids, wait_until

CPU = {
    "dtype": "float32",
    "device": "cpu",
    "attention_backend": "torch_native",
    "sampling_backend": "pytorch",
    "enable_deterministic_inference": False,
}
GPU_EXACT = {
    "dtype": "bfloat16",
    "device": "cuda",
    "attention_backend": "flashinfer",
    "sampling_backend": "pytorch",
    "enable_deterministic_inference": True,
}


@contextlib.contextmanager
def numerics(
    monkeypatch: pytest.MonkeyPatch, by_port: dict[int, dict[str, Any]] | None = None, **default: Any
) -> Iterator[None]:
    """Stand-ins answer /server_info with these numerics (by port, else `default`)."""
    original = SGLangStandIn._server_info

    async def server_info(self: SGLangStandIn, request: web.Request) -> web.Response:
        resp = await original(self, request)
        assert isinstance(resp, web.Response) and resp.body is not None
        doc = json.loads(bytes(resp.body))  # type: ignore[arg-type]
        port = int(self.url.rsplit(":", 1)[1])
        doc.update((by_port or {}).get(port, default))
        return web.json_response(doc)

    monkeypatch.setattr(SGLangStandIn, "_server_info", server_info)
    yield


async def judged(gw: Any, n: int) -> None:
    await wait_until(
        lambda: sum("/server_info" not in w.determinism.note for w in gw.monitor.workers.values()) == n, 10.0
    )


async def test_workers_show_their_determinism_and_sampled_requests_say_the_replay_is_not_reproducible(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with numerics(monkeypatch, **CPU):
        async with sglang_cluster(n=2) as (gw, _servers, http):
            await judged(gw, 2)
            async with http.get(
                "/admin/workers", headers={"Authorization": f"Bearer {gw.config.gateway.admin_api_keys[0]}"}
            ) as resp:
                workers = await resp.json()
            for w in workers:
                d = w["determinism"]
                assert d["label"] == "not-promised" and not d["bit_equal"] and not d["seeded"], d
                assert "float32 on cpu" in d["note"] and "exact in practice" in d["note"]
                assert w["detection"]["fail_after_ms"] > 0
            # a seeded sampled request is served, and says its replay is not reproducible
            body = {"prompt": list(b"seeded"), "max_tokens": 8, "temperature": 0.8, "seed": 7}
            for stream in (False, True):
                async with http.post("/v1/completions", json={**body, "stream": stream}) as resp:
                    assert resp.status == 200
                    note = resp.headers.get("Lumen-Replay", "")
                    raw = await resp.read()
                assert note.startswith("not-reproducible") and "sampling_seed ignored by sg0, sg1" in note
                if not stream:
                    assert json.loads(raw)["object"] == "text_completion"  # the body is OpenAI's
            # a greedy one needs no seed: nothing said
            async with http.post("/v1/completions", json={**body, "temperature": 0.0}) as resp:
                assert resp.status == 200 and "Lumen-Replay" not in resp.headers


async def test_servers_launched_for_exactness_say_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    with numerics(monkeypatch, **GPU_EXACT):
        async with sglang_cluster(n=2) as (gw, _servers, http):
            await judged(gw, 2)
            assert all(w.determinism.label == "exact" for w in gw.monitor.workers.values())
            body = {"prompt": list(b"seeded"), "max_tokens": 8, "temperature": 0.8, "seed": 7}
            async with http.post("/v1/completions", json=body) as resp:
                assert resp.status == 200 and "Lumen-Replay" not in resp.headers


@pytest.mark.parametrize("victim_exact", [False, True])
async def test_resumes_off_or_onto_servers_that_promise_nothing_are_counted(
    monkeypatch: pytest.MonkeyPatch, victim_exact: bool
) -> None:
    by_port: dict[int, dict[str, Any]] = {}
    with numerics(monkeypatch, by_port, **CPU):
        async with sglang_cluster(n=2) as (gw, servers, http):
            # one server promises bit-equal replays, the other does not: read again on a new incarnation
            by_port[int(servers[0].url.rsplit(":", 1)[1])] = GPU_EXACT
            for w in list(gw.monitor.workers.values()):
                gw.monitor.report_data_failure(w.id, w.incarnation, "re-read /server_info")
            await wait_until(lambda: gw.monitor.healthy_count() == 2, 10.0)
            await judged(gw, 2)
            prompts = [list(b"resume %d" % i) for i in range(4)]
            tasks = [asyncio.create_task(stream_ids(http, p, False)) for p in prompts]
            await wait_until(
                lambda: (
                    sum(len(s.engine.running) for s in servers) == len(prompts)
                    and all(len(live.output_ids) >= 4 for s in servers for live in s.engine.running)
                ),
                10.0,
            )
            exact = servers[0]
            victim = exact if victim_exact else servers[1]
            if not victim.engine.running:  # the router put nothing there: the other one then
                victim = servers[1] if victim is exact else exact
            moved = len(victim.engine.running)
            await victim.kill()
            got = await asyncio.wait_for(asyncio.gather(*tasks), 30.0)
            assert got == [expected_ids(p, 48, 0.0) for p in prompts]  # coherent: exact tokens, no gap
            text = gw.metrics.render().decode()
            side = "onto" if victim is exact else "off"
            assert f'lumen_nonexact_resumes_total{{side="{side}"}} {float(moved)}' in text, text
            other = "off" if side == "onto" else "onto"
            assert f'lumen_nonexact_resumes_total{{side="{other}"}}' not in text
            victim_id = next(w.id for w in gw.monitor.workers.values() if w.http_url == victim.url)
            assert gw.monitor.workers[victim_id].state is WorkerState.FAILED


def test_cluster_status_prints_the_replay_judgement(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [
        {"id": "sg0", "state": "HEALTHY", "incarnation": 1, "running": 0, "waiting": 0, "load": 0.0,
         "determinism": {"label": "not-promised", "note": "float32 on cpu (...): greedy replays exact in practice"}},
        {"id": "w1", "state": "HEALTHY", "incarnation": 2, "running": 1, "waiting": 0, "load": 0.1,
         "determinism": {"label": "exact", "note": "Lumen worker"}},
    ]  # fmt: skip
    monkeypatch.setattr(cli_admin, "_admin", lambda port, method, path: rows)
    assert cli_admin.cmd_cluster_status(argparse.Namespace(port=1)) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("replay=not-promised") and "exact in practice" in out[1]
    assert out[2].endswith("replay=exact") and len(out) == 3
