"""Test-suite settings shared by every directory."""

import gc
import os

from hypothesis import settings

# CI runs are reproducible (derandomized examples) and immune to a slow shared machine (no deadline);
# locally hypothesis explores new examples on every run.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


def pytest_collection_finish(session: object) -> None:
    """Every test module (torch included) is imported by now: move those long-lived objects out of the
    cyclic collector's reach, so a full collection during a timing-sensitive test (heartbeats, stall
    timeouts) does not walk ~10^5 of them (about 70 ms on this 2-core box with torch loaded)."""
    gc.collect()
    gc.freeze()
