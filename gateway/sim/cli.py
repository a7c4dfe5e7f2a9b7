"""`lumen sim` and `lumen tune` (the discrete-event simulator's command line)."""

from __future__ import annotations

import argparse
from typing import Any


def add_sim_commands(sub: Any) -> None:
    """Register the simulator's subcommands on the `lumen` parser (filled in with the simulator)."""
    del sub


def _unused(args: argparse.Namespace) -> int:  # pragma: no cover - placeholder until the simulator lands
    return 2
