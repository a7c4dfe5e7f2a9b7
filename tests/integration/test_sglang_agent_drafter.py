"""The SGLang agent's drafter (worker_hooks/sglang/agent_draft.py): bound once, it drafts with a real
(tiny, random) torch draft model only while a relaunched server loads, and says so in the phases its
sessions report. A draft-plane client asks it for drafts as the gateway does."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from draft_models.client import DraftClient
from gateway.protocol import control_pb2 as pb
from gateway.protocol.planes import PLAINTEXT
from models.torch_config import PRESETS
from models.torch_weights import random_model, save_model
from tests.integration.test_draft_plane import connect
from worker_hooks.sglang.agent_draft import RestartDrafter

TIMEOUT = 10.0


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("draft")
    save_model(random_model(PRESETS["tiny"], seed=3), folder)
    return folder


async def until(cond: Any, within: float = TIMEOUT) -> None:
    async with asyncio.timeout(within):
        while not cond():
            await asyncio.sleep(0.005)


async def drafts(client: DraftClient, round: int, context: list[int], k: int = 3) -> tuple[int, ...]:
    client.request(round, [client.sync_item(f"r{round}", context, k)])
    got = await client.poll(round, TIMEOUT)
    assert got is not None
    return tuple(got[f"r{round}"].tokens)


@pytest.fixture
async def drafter(draft_dir: Path) -> AsyncIterator[tuple[RestartDrafter, list[dict[str, Any]]]]:
    events: list[dict[str, Any]] = []
    d = RestartDrafter(
        "sg0",
        str(draft_dir),
        auth=PLAINTEXT,
        host="127.0.0.1",
        draft_timeout_ms=50,
        emit=lambda event, **f: events.append({"event": event, **f}),
    )
    await d.start()
    yield d, events
    await d.close()


async def test_it_drafts_only_while_a_relaunched_server_loads(
    drafter: tuple[RestartDrafter, list[dict[str, Any]]],
) -> None:
    d, events = drafter
    assert d.endpoint.startswith("tcp://127.0.0.1:")  # bound before the first Hello
    assert d.phase() is None  # the first start is not a restart: LOADING_FULL
    client = DraftClient(d.endpoint, auth=PLAINTEXT)
    try:
        await connect(client)
        assert await drafts(client, 1, [5, 6, 7]) == ()  # nothing loaded: no drafts
        d.relaunching()
        assert d.phase() == pb.LOADING_DRAFT
        await until(lambda: d.phase() == pb.DRAFT_READY)
        assert [e["event"] for e in events] == ["draft_loading", "draft_ready"]
        start = pb.GatewayMessage(start_draft_assist=pb.StartDraftAssist(peer_id="sg1", role="drafter", k=3))
        assert d.command(start) and d.role.peers == {"sg1"}
        assert len(await drafts(client, 2, [5, 6, 7])) == 3
        d.command(pb.GatewayMessage(stop_draft_assist=pb.StopDraftAssist(peer_id="sg1")))
        d.served()  # the relaunched server serves: the drafter retires, its socket stays
        assert d.phase() is None
        await until(lambda: events[-1]["event"] == "draft_retired")
        assert events[-1]["drafted"] == 3
        assert await drafts(client, 3, [5, 6, 7]) == ()
        assert d.endpoint  # the next relaunch drafts on the same endpoint
        d.relaunching()
        await until(lambda: d.phase() == pb.DRAFT_READY)
        assert len(await drafts(client, 4, [8, 9])) == 3
    finally:
        client.close()


async def test_a_skip_from_the_gateway_or_a_model_that_cannot_load_makes_a_plain_relaunch(
    drafter: tuple[RestartDrafter, list[dict[str, Any]]], tmp_path: Path
) -> None:
    d, events = drafter
    d.relaunching()
    d.skip()  # Welcome.skip_draft: the assist gate says drafting would not pay
    assert d.phase() is None and not d.role.ready
    await asyncio.sleep(0)
    assert "draft_skipped" in [e["event"] for e in events]
    # a target command for an SGLang server is the gateway's business, not the drafter's
    assert not d.command(
        pb.GatewayMessage(start_draft_assist=pb.StartDraftAssist(peer_id="x", role="target"))
    )
    broken = RestartDrafter("sg2", str(tmp_path), auth=PLAINTEXT, host="127.0.0.1", emit=lambda *a, **k: None)
    await broken.start()
    try:
        broken.relaunching()
        await until(lambda: broken.failed)
        assert broken.phase() is None  # LOADING_FULL: a relaunch without drafting
    finally:
        await broken.close()
