"""Test-suite settings shared by every directory."""

import asyncio
import gc
import inspect
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from hypothesis import settings

# CI runs are reproducible (derandomized examples) and immune to a slow shared machine (no deadline);
# locally hypothesis explores new examples on every run.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture(
    params=[
        pytest.param(settings(max_examples=50), id="quick"),
        pytest.param(settings(max_examples=400), id="thorough", marks=pytest.mark.slow),
    ]
)
def search(request: pytest.FixtureRequest) -> settings:
    """How hard a costly property searches: a test that takes this fixture runs its property as
    `search(given(...)(check))()` and comes out twice, [quick] in the default run and [thorough]
    (marked slow) in `-m slow`."""
    return request.param


TESTS = Path(__file__).parent
# a directory's tests carry its marker whatever their modules say (a conftest's `pytestmark` marks nothing)
DIRECTORY_MARKERS = {
    TESTS / "e2e": pytest.mark.e2e,
    TESTS / "gpu": pytest.mark.gpu,
    TESTS / "sglang": pytest.mark.sglang,  # the real sglang package: `./dev sglang-test`
    TESTS / "chaos": pytest.mark.chaos,  # network namespaces (root): tests/chaos
}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if isinstance(item, pytest.Function) and inspect.iscoroutinefunction(item.obj):
            item.fixturenames.append("_dump_tasks_before_timeout")
        for directory, marker in DIRECTORY_MARKERS.items():
            if item.path.is_relative_to(directory):
                item.add_marker(marker)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """While collecting: what each module just imported (torch, hypothesis, schemathesis, ...) leaves the
    cyclic collector's reach at once (a freeze, no collection: the little garbage of an import stays).
    Else the full collections that ~150 imports set off walk an ever larger heap: ~3 s of an ~8.5 s
    collection here."""
    gc.freeze()


def pytest_collection_finish(session: object) -> None:
    """Every test module (torch included) is imported by now: move those long-lived objects out of the
    cyclic collector's reach, so a full collection during a timing-sensitive test (heartbeats, stall
    timeouts) does not walk ~10^5 of them (about 70 ms on this 2-core box with torch loaded)."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="module", autouse=True)
def _freeze_what_earlier_modules_left() -> None:
    """The same at each test module's start, for what the modules before it left alive (modules they
    imported late, such as torch's compiler stack and sympy, caches, the session's reports): after a
    collection (their garbage is freed first) they leave the collector's reach too. Without it the heap
    the collector walks grows through the session, to ~3x10^5 objects and 0.2-0.4 s a full collection
    by the unit tests, and ~40 such collections fall inside tests."""
    gc.collect()
    gc.freeze()


TASK_DUMP_BEFORE_TIMEOUT_S = 10.0  # an async test still running this long before pytest-timeout fires


@pytest_asyncio.fixture
async def _dump_tasks_before_timeout(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    """A hung async test tells where its tasks wait: shortly before pytest-timeout ends it, every
    asyncio task's stack goes to stderr (pytest-timeout shows threads only; the tasks are the story).
    Added to every coroutine test at collection (below)."""
    marker = request.node.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker and marker.args else float(request.config.getini("timeout") or 0)

    def dump() -> None:
        print(f"\n--- asyncio tasks {TASK_DUMP_BEFORE_TIMEOUT_S:g} s before the timeout ---", file=sys.stderr)
        for task in asyncio.all_tasks():
            print(repr(task), file=sys.stderr)
            task.print_stack(limit=8, file=sys.stderr)

    handle = None
    if limit > TASK_DUMP_BEFORE_TIMEOUT_S:
        handle = asyncio.get_running_loop().call_later(limit - TASK_DUMP_BEFORE_TIMEOUT_S, dump)
    yield
    if handle is not None:
        handle.cancel()
