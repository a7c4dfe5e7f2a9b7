"""The gateway as built: the recovery coordinator is the one listener of the worker registry's state
changes and of the control plane's attaches and heartbeats, in every recovery mode (issue 28; the
import-boundary test holds the source to it, this holds the assembled object)."""

from __future__ import annotations

import pytest

from gateway.config import load_config
from gateway.core.modes import MODES
from gateway.server.app import Gateway


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_coordinator_is_the_only_listener(mode: str) -> None:
    gw = Gateway(load_config(overrides={"gateway.port": 0, "recovery.mode": mode}))
    c = gw.coordinator
    assert gw.monitor.on_state_change == [c.on_state_change]
    assert gw.control.heartbeat_hooks == [c.on_heartbeat]
    assert gw.control.attach_hooks == [c.on_attach]
    assert gw.levers.boost_hooks == [c.boosted]
    assert gw.control.draft_first == c.draft_first
    # what the mode has, the coordinator calls: re-homing with checkpoints, the pairing gate with assist
    assert (c.rehoming is not None) == gw.policy.checkpointing
    assert (c.assist is not None) == gw.policy.draft_assist
