"""The dependency rules of docs/design.md §2, checked on the source (an import-linter equivalent).

Every import counts, lazy ones inside functions included; only `if TYPE_CHECKING:` blocks are left
out of the module-cycle check (they never run), never out of the part rules.

Parts and the one direction imports may go (a part may import itself and what it lists):

    gateway.core, gateway.protocol              nothing of the project
    gateway.config                              core, protocol
    gateway.server                              core, protocol, config
    gateway.sim                                 core, protocol, config
    gateway.cluster                             core, protocol, config, server
    gateway.cli                                 every gateway part, loadtests (lazily, for its commands)
    models                                      core, protocol
    draft_models                                core, protocol, models
    worker_hooks                                core, protocol, models, draft_models
    loadtests                                   core, protocol, config, sim, models, draft_models, worker_hooks
"""

from __future__ import annotations

import ast
import functools
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOP_PACKAGES = ("gateway", "models", "draft_models", "worker_hooks", "loadtests")
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
GATEWAY_PROCESS_FORBIDDEN = ("torch", "sglang", "safetensors", "worker_hooks", "draft_models", "models")

_CORE = {"gateway.core", "gateway.protocol"}
ALLOWED: dict[str, set[str]] = {
    "gateway.core": set(),
    "gateway.protocol": set(),
    "gateway.config": _CORE,
    "gateway.server": _CORE | {"gateway.config"},
    "gateway.sim": _CORE | {"gateway.config"},
    "gateway.cluster": _CORE | {"gateway.config", "gateway.server"},
    "gateway.cli": _CORE
    | {"gateway.config", "gateway.server", "gateway.sim", "gateway.cluster", "loadtests"},
    "models": _CORE,
    "draft_models": _CORE | {"models"},
    "worker_hooks": _CORE | {"models", "draft_models"},
    "loadtests": _CORE | {"gateway.config", "gateway.sim", "models", "draft_models", "worker_hooks"},
}
# the worker side shares with the gateway only the wire schemas and these pure models: the cost
# model, the Phase enum, the speculation math (adaptive k) and the draft-pair registry
ALLOWED_ON_WORKERS = (
    "gateway.protocol",
    "gateway.core.costmodel",
    "gateway.core.health",
    "gateway.core.speculation",
    "gateway.core.draftpairs",
    "gateway.core.outage",  # the queue order and batch limit the engine shares with the simulator (issue 17)
    "gateway.core.reload",  # a draft-first restart's timeline (DraftFirst), the simulator's too
    "gateway.core.polls",  # the SGLang agent judges its server's polls by the gateway's rule (issue 27)
    "gateway.core.determinism",  # which attention backends take deterministic inference: one list (issue 27)
)


@dataclass(frozen=True)
class Import:
    target: str  # the imported name, absolute (`from x import y` gives x and x.y)
    type_only: bool  # inside `if TYPE_CHECKING:`


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_modules() -> dict[str, Path]:
    return {
        module_name(p): p for pkg in TOP_PACKAGES for p in (ROOT / pkg).rglob("*.py") if "_pb2" not in p.name
    }


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def imports_of(path: Path, module: str | None = None) -> list[Import]:
    """Every import in the file, at any depth, relative ones made absolute."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module = module or module_name(path)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    type_only = _type_checking_nodes(tree)
    out: list[Import] = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                mod = ".".join([*base, *([node.module] if node.module else [])])
            else:
                mod = node.module or ""
            names = [mod, *(f"{mod}.{a.name}" for a in node.names)]
        out.extend(Import(n, id(node) in type_only) for n in names)
    return out


def part_of(name: str) -> str | None:
    s = name.split(".")
    if s[0] == "gateway":
        return f"gateway.{s[1]}" if len(s) > 1 and f"gateway.{s[1]}" in ALLOWED else None
    return s[0] if s[0] in ALLOWED else None


def _resolve(name: str, known: Set[str]) -> str | None:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in known:
            return ".".join(parts[:i])
    return None


@functools.cache
def _source_imports() -> dict[str, tuple[Import, ...]]:
    """Every source module's imports, parsed once a run (the tree does not change during one)."""
    return {m: tuple(imports_of(p, m)) for m, p in source_modules().items()}


def module_graph(runtime_only: bool) -> dict[str, set[str]]:
    """A new graph on every call (the checker's own tests plant edges in theirs)."""
    imports = _source_imports()
    graph: dict[str, set[str]] = {m: set() for m in imports}
    for m, imps in imports.items():
        for imp in imps:
            if runtime_only and imp.type_only:
                continue
            r = _resolve(imp.target, imports.keys())
            if r is not None and r != m:
                graph[m].add(r)
    return graph


def part_violations(graph: Mapping[str, Iterable[str]], allowed: Mapping[str, set[str]]) -> list[str]:
    """Module edges that go between parts against `allowed`."""
    bad = []
    for a, targets in graph.items():
        pa = part_of(a)
        for b in targets:
            pb = part_of(b)
            if pa and pb and pa != pb and pb not in allowed.get(pa, set()):
                bad.append(f"{a} -> {b} ({pa} may not import {pb})")
    return sorted(bad)


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


# -- the rules on the tree --------------------------------------------------------------------------


def test_every_module_belongs_to_a_part() -> None:
    # `gateway/__init__.py` is the namespace of the gateway's parts and imports nothing (issue 28); the
    # simulator's native loader, when LUMEN_SIM_NATIVE asks for it, is the simulator package's, and
    # imports the standard library alone (gateway/sim/native.py)
    assert imports_of(ROOT / "gateway" / "__init__.py") == []
    assert {i.target for i in imports_of(ROOT / "gateway" / "sim" / "__init__.py")} == {
        "os",
        "gateway.sim.native",
        "gateway.sim.native.activate",
    }
    first_party = ("gateway", "worker_hooks", "models", "draft_models", "loadtests")
    native = imports_of(ROOT / "gateway" / "sim" / "native.py")
    assert [i.target for i in native if i.target.split(".")[0] in first_party] == []
    assert [m for m in source_modules() if m != "gateway" and not part_of(m)] == []


def test_parts_import_one_way() -> None:
    assert part_violations(module_graph(runtime_only=False), ALLOWED) == []


def test_the_part_rules_have_no_cycle() -> None:
    assert cycles({p: ALLOWED[p] for p in ALLOWED}) == []


def test_no_module_import_cycle() -> None:
    assert cycles(module_graph(runtime_only=True)) == []


@pytest.mark.parametrize(
    "path", [p for m, p in source_modules().items() if m.startswith("gateway.core")], ids=str
)
def test_core_is_pure(path: Path) -> None:
    for imp in imports_of(path):
        assert imp.target.split(".")[0] not in IO_LIBS, f"{path}: gateway.core must not import {imp.target}"
        if part_of(imp.target):
            assert imp.target.startswith("gateway.core"), f"{path}: gateway.core imports {imp.target}"


@pytest.mark.parametrize(
    "path", [p for m, p in source_modules().items() if m.startswith("gateway.protocol")], ids=str
)
def test_protocol_imports_nothing_else_from_the_project(path: Path) -> None:
    for imp in imports_of(path):
        if part_of(imp.target):
            assert imp.target.startswith("gateway.protocol"), f"{path}: gateway.protocol imports {imp.target}"


@pytest.mark.parametrize(
    "path",
    [p for m, p in source_modules().items() if m.startswith(("gateway.server", "gateway.sim"))],
    ids=str,
)
def test_server_and_sim_do_not_import_each_other_or_heavy_libs(path: Path) -> None:
    other = "gateway.sim" if "server" in path.parts else "gateway.server"
    for imp in imports_of(path):
        assert not imp.target.startswith(other), f"{path} imports {imp.target}"
        assert imp.target.split(".")[0] not in GATEWAY_PROCESS_FORBIDDEN, (
            f"{path}: the gateway process imports {imp.target}"
        )


@pytest.mark.parametrize(
    "path",
    [p for m, p in source_modules().items() if part_of(m) in ("worker_hooks", "draft_models", "models")],
    ids=str,
)
def test_worker_side_uses_only_protocol_and_shared_models(path: Path) -> None:
    for imp in imports_of(path):
        if imp.target.startswith("gateway."):
            assert imp.target.startswith(ALLOWED_ON_WORKERS), f"{path}: worker side imports {imp.target}"


def test_the_gateway_process_never_loads_the_worker_side() -> None:
    """What `lumen gateway` and `lumen cluster up` import, statically (lazy imports included) and at run
    time: no torch, sglang, worker_hooks, draft_models or models."""
    graph = module_graph(runtime_only=False)
    seen, todo = set(), ["gateway.server.runner", "gateway.cluster.fleet_run", "gateway.config"]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(graph.get(m, ()))
    assert not [m for m in seen if m.split(".")[0] in GATEWAY_PROCESS_FORBIDDEN]
    for m in seen:
        for imp in imports_of(source_modules()[m], m):
            assert imp.target.split(".")[0] not in GATEWAY_PROCESS_FORBIDDEN, f"{m} imports {imp.target}"
    code = (
        "import sys, gateway.server.runner, gateway.cluster.fleet_run, gateway.cli\n"
        f"bad = [m for m in sys.modules if m.split('.')[0] in {GATEWAY_PROCESS_FORBIDDEN!r}]\n"
        "print(','.join(sorted(bad)))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


# the worker registry's listener lists: a module that adds itself to one subscribes to the workers
WORKER_HOOKS = ("on_state_change", "heartbeat_hooks", "attach_hooks")
# the one module under gateway/server that may (issue 28: what a failure sets off is written there)
RECOVERY_COORDINATOR = "gateway.server.recovery.coordinator"


def worker_subscriptions(path: Path) -> list[str]:
    """Where `path` adds a listener to the worker registry's state changes or the control plane's
    attaches and heartbeats (`<x>.on_state_change.append(...)` and the like), as "line: hook"."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("append", "insert", "extend", "__iadd__")
            and isinstance(node.func.value, ast.Attribute)
            and node.func.value.attr in WORKER_HOOKS
        ):
            found.append(f"{node.lineno}: {node.func.value.attr}")
    return found


@pytest.mark.parametrize(
    "path",
    [p for m, p in source_modules().items() if m.startswith("gateway.server") and m != RECOVERY_COORDINATOR],
    ids=str,
)
def test_only_the_recovery_coordinator_subscribes_to_the_workers(path: Path) -> None:
    """No module under gateway/server but recovery/coordinator.py listens to worker-state changes (or to
    the control plane's attaches and heartbeats): the reaction to a failure is written in one place."""
    assert worker_subscriptions(path) == [], f"{path} subscribes; call it from {RECOVERY_COORDINATOR}"


# -- the checker itself catches what it must -------------------------------------------------------


def test_a_planted_back_edge_is_caught(tmp_path: Path) -> None:
    graph = module_graph(runtime_only=False)
    graph["gateway.core.load"] = {*graph["gateway.core.load"], "gateway.server.app"}
    graph["gateway.protocol.kv"] = {*graph["gateway.protocol.kv"], "worker_hooks.kv.store"}
    assert part_violations(graph, ALLOWED) == [
        "gateway.core.load -> gateway.server.app (gateway.core may not import gateway.server)",
        "gateway.protocol.kv -> worker_hooks.kv.store (gateway.protocol may not import worker_hooks)",
    ]


def test_a_lazy_import_counts_and_a_type_only_one_only_for_parts(tmp_path: Path) -> None:
    f = tmp_path / "mod.py"
    f.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from gateway.server.app import Gateway\n"
        "def run():\n    from worker_hooks.engine import engine\n"
    )
    imps = imports_of(f, "gateway.core.mod")
    assert Import("gateway.server.app", True) in imps and Import("worker_hooks.engine", False) in imps


def test_a_planted_cycle_is_caught() -> None:
    graph = module_graph(runtime_only=True)
    graph["gateway.core.types"] = {*graph["gateway.core.types"], "gateway.core.dispatch"}
    found = cycles(graph)
    assert any({"gateway.core.types", "gateway.core.dispatch"} <= set(c) for c in found)


def test_a_planted_subscription_is_caught(tmp_path: Path) -> None:
    f = tmp_path / "mod.py"
    f.write_text(
        "class A:\n    def __init__(self, monitor):\n        monitor.on_state_change.append(self.x)\n"
    )
    assert worker_subscriptions(f) == ["3: on_state_change"]
    assert worker_subscriptions(ROOT / "gateway/server/recovery/coordinator.py")  # it does subscribe


# -- one exception tree per wire (issue 28) ----------------------------------------------------------


def exception_classes(modules: Mapping[str, Path]) -> dict[str, list[str]]:
    """Exception class name -> the modules declaring a class of that name. A class is an exception
    when one of its bases is: a builtin exception, a project exception (transitively), or a foreign
    class whose name ends in Error or Exception (msgspec.ValidationError, grpc.RpcError, ...)."""
    import builtins

    bases: dict[str, list[tuple[str, list[str]]]] = {}
    for m, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                names = [ast.unparse(b).rpartition(".")[2] for b in node.bases]
                bases.setdefault(node.name, []).append((m, names))
    exc = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
    grew = True
    while grew:
        grew = False
        for name, decls in bases.items():
            if name not in exc and any(
                b in exc or b.endswith(("Error", "Exception")) for _, bs in decls for b in bs
            ):
                exc.add(name)
                grew = True
    return {name: sorted(m for m, _ in decls) for name, decls in bases.items() if name in exc}


def test_no_exception_class_name_is_declared_in_two_product_modules() -> None:
    """One OpenAI error tree (gateway/protocol/openai/errors.py) for the gateway and Lumen's worker
    server; every other exception is declared once. A re-export (`from x import E`) is no declaration."""
    twice = {n: ms for n, ms in exception_classes(source_modules()).items() if len(set(ms)) > 1}
    assert twice == {}


def test_a_second_declaration_of_an_exception_name_is_caught(tmp_path: Path) -> None:
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("class Base(Exception): ...\nclass NotFound(Base): ...\nclass Plain: ...\n")
    b.write_text("import x\nclass NotFound(x.OpenAIError): ...\nclass Plain: ...\n")
    found = exception_classes({"p.a": a, "p.b": b})
    assert found == {"Base": ["p.a"], "NotFound": ["p.a", "p.b"]}


def test_importing_the_shared_core_runs_nothing_of_the_simulator() -> None:
    """`import gateway.protocol` (what a worker imports) loads no simulator module, not even with
    LUMEN_SIM_NATIVE set: the native build is activated by the simulator package alone."""
    code = "import sys, gateway.protocol, gateway.core.costmodel\nprint(sorted(m for m in sys.modules if m.startswith('gateway.sim')))"
    env = {**os.environ, "LUMEN_SIM_NATIVE": str(ROOT / "no-such-build"), "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-W", "error", "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
