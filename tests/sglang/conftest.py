"""The real-SGLang lane (`./dev sglang-test`): every test here imports the sglang package.

tests/conftest.py marks everything under this folder `sglang`, and the default run deselects that
marker; modules are not even collected where sglang is not installed (the project's own .venv), so the
default run never imports it.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest

if importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["test_*.py"]

# one SGLang API key for the lane (issue 30): an agent launches its server with it (instead of one it
# generates, which a test's own direct calls to the server could not know), every gateway sends it to
# every server, and tests/sglang/real.py's direct calls carry it. Servers a test starts without
# --api-key take the bearer and ignore it.
os.environ.setdefault("LUMEN_SGLANG_API_KEY", "lumen-real-lane-sglang-key-0123456789")


@pytest.fixture(autouse=True)
def plane_members(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the sidecar agents' plane files and the gateway's Members give the servers built here: each
    page store its own CURVE keys (as each server's agent generates), all of them members of one table
    (as every plane file lists every member), so their KV planes trust each other and nobody else."""
    from gateway.protocol.planes import Member, MemberTable, PlaneAuth
    from worker_hooks.sglang import hicache_backend
    from worker_hooks.sglang.page_routes import RouteLookup
    from worker_hooks.sglang.page_store import PageStore
    from worker_hooks.sglang.page_store_config import PageStoreConfig

    table = MemberTable()
    members: list[Member] = []

    def page_store(config: PageStoreConfig, routes: RouteLookup, **kw: Any) -> PageStore:
        auth = PlaneAuth.generate(table)
        store = PageStore(config, routes, auth=auth, **kw)
        members.append(Member(config.worker_id, config.incarnation, auth.keys.public, store.endpoint))
        table.replace(members)
        return store

    monkeypatch.setattr(hicache_backend, "PageStore", page_store)


@pytest.fixture(scope="session")
def real_servers(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Real SGLang servers of the tiny target on CPU, shared by the lane's tests (tests/sglang/real.py)."""
    from tests.sglang.real import ServerPool

    pool = ServerPool(tmp_path_factory.mktemp("sglang-logs"))
    yield pool
    pool.close()
