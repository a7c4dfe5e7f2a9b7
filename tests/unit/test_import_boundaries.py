"""DESIGN 2's dependency rules, checked on the source (an import-linter equivalent)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
IO_LIBS = {
    "asyncio",
    "aiohttp",
    "grpc",
    "zmq",
    "torch",
    "sglang",
    "logging",
    "structlog",
    "time",
    "random",
    "socket",
    "os",
    "subprocess",
    "uvloop",
    "threading",
}


# the worker side may use the wire schemas and the pure models it shares with the gateway: the cost
# model, the Phase enum, and the speculation math (adaptive k) its target loop runs
ALLOWED_ON_WORKERS = (
    "gateway.protocol",
    "gateway.core.costmodel",
    "gateway.core.health",
    "gateway.core.speculation",
)


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def modules(pkg: str) -> list[Path]:
    return [p for p in (ROOT / pkg).rglob("*.py") if "_pb2" not in p.name]


def top(name: str) -> str:
    return name.split(".")[0]


@pytest.mark.parametrize("path", modules("gateway/core"), ids=str)
def test_core_is_pure(path: Path) -> None:
    for imp in imports_of(path):
        assert top(imp) not in IO_LIBS, f"{path}: gateway.core must not import {imp}"
        if top(imp) in ("gateway", "worker_hooks", "draft_models", "loadtests"):
            assert imp.startswith("gateway.core"), f"{path}: gateway.core imports {imp}"


@pytest.mark.parametrize("path", modules("gateway/protocol"), ids=str)
def test_protocol_imports_nothing_else_from_the_project(path: Path) -> None:
    for imp in imports_of(path):
        if top(imp) in ("gateway", "worker_hooks", "draft_models", "loadtests"):
            assert imp.startswith("gateway.protocol"), f"{path}: gateway.protocol imports {imp}"


@pytest.mark.parametrize("path", modules("gateway/server") + modules("gateway/sim"), ids=str)
def test_server_and_sim_do_not_import_each_other_or_heavy_libs(path: Path) -> None:
    other = "gateway.sim" if "server" in path.parts else "gateway.server"
    for imp in imports_of(path):
        assert not imp.startswith(other), f"{path} imports {imp}"
        assert top(imp) not in ("torch", "sglang", "worker_hooks"), (
            f"{path}: the gateway process imports {imp}"
        )


@pytest.mark.parametrize("path", modules("worker_hooks") + modules("draft_models"), ids=str)
def test_worker_side_uses_only_protocol_and_cost_model(path: Path) -> None:
    for imp in imports_of(path):
        if imp.startswith("gateway."):
            assert imp.startswith(ALLOWED_ON_WORKERS), f"{path}: worker side imports {imp}"
        if "draft_models" in path.parts:
            assert not imp.startswith("gateway.server"), f"{path} imports {imp}"
