"""Test-suite settings shared by every directory."""

import gc
import os
from pathlib import Path

import pytest
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
}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for directory, marker in DIRECTORY_MARKERS.items():
            if item.path.is_relative_to(directory):
                item.add_marker(marker)


def pytest_collection_finish(session: object) -> None:
    """Every test module (torch included) is imported by now: move those long-lived objects out of the
    cyclic collector's reach, so a full collection during a timing-sensitive test (heartbeats, stall
    timeouts) does not walk ~10^5 of them (about 70 ms on this 2-core box with torch loaded)."""
    gc.collect()
    gc.freeze()
