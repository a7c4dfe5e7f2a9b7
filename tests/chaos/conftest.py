"""Chaos tests: Lumen's gateways, workers and the load client each in a network namespace (root).

They skip, saying why, where namespaces or nftables are unavailable; every test checks afterwards that
none of its namespaces is left (`ip netns`)."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from loadtests.chaos.netfaults import nft_missing
from loadtests.chaos.netns import cleanup_leftovers, missing_tools, ours
from loadtests.chaos.orchestrate import ChaosResult, ChaosSetup, run_chaos


def why_not() -> str | None:
    return missing_tools() or nft_missing() or (None if shutil.which("openssl") else "openssl is missing")


@pytest.fixture(autouse=True)
def _needs_namespaces() -> None:
    if reason := why_not():
        pytest.skip(f"chaos tests need namespaces and nftables: {reason}")


@pytest.fixture
def chaos(tmp_path: Path) -> Iterator[Callable[..., ChaosResult]]:
    """Run a ChaosSetup (keyword arguments) in a fresh lab; afterwards no namespace of ours is left."""
    cleanup_leftovers()
    runs = 0

    def run(**kw: Any) -> ChaosResult:
        nonlocal runs
        runs += 1
        return run_chaos(ChaosSetup(**kw), tmp_path / f"run{runs}")

    yield run
    assert ours() == [], f"namespaces left behind: {ours()}"
