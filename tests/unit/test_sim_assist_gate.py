"""The simulator's draft-assist decisions through the cost gate (gateway.sim.coordinator, issue 17):
a restart loads its draft model first only if drafting for an overloaded survivor makes up for the
full model serving later (the simulator loads the draft model, then the full weights)."""

from typing import Any

import numpy as np
import pytest

from gateway.core.costmodel import CostModel
from gateway.core.modes import policy_for
from gateway.sim.coordinator import assist_gate
from gateway.sim.result import RunResult
from gateway.sim.scenario import DraftSpec, parse_scenario
from gateway.sim.simulation import Simulation
from gateway.sim.workload import Workload

TARGET = CostModel.preset("Qwen3-32B", "H100-80G")
DRAFTER = CostModel.preset("Qwen3-1.7B", "H100-80G")


def overloaded_run(draft: dict[str, Any], boost: float = 1.0) -> RunResult:
    # 400 conversation-sized requests at once on 2 workers; w0 dies at 0.5 s, so w1 alone holds a
    # full batch and a queue through the whole reload (without the outage batch boost unless asked)
    s = parse_scenario(
        {
            "cluster": {"workers": 2},
            "workload": {"rate": 1.0},
            "failures": [{"at_s": 0.5, "workers": ["w0"]}],
            "draft": draft,
            "recovery": {"outage_batch_boost": boost},
        }
    )
    n = 400
    w = Workload(np.zeros(n), np.full(n, 1155, dtype=np.int64), np.full(n, 211, dtype=np.int64))
    return Simulation(s, policy_for("lumen"), w, seed=1).run()


def test_the_gate_charges_the_simulators_serial_draft_load() -> None:
    gate = assist_gate(DraftSpec(), TARGET, DRAFTER, 64)
    assert gate is not None
    assert gate.load_delay_s == pytest.approx(DRAFTER.weights_time())  # 1.7 s
    assert gate.assist_window_s == pytest.approx(TARGET.weights_time())  # 16.4 s
    own = assist_gate(DraftSpec(), TARGET, DRAFTER, 64, load_delay_s=0.0, assist_window_s=6.0)
    assert own is not None and (own.load_delay_s, own.assist_window_s) == (0.0, 6.0)
    assert assist_gate(DraftSpec(assist_gate=False), TARGET, DRAFTER, 64) is None


def test_a_conversation_load_does_not_load_the_draft_first() -> None:
    # a full batch completes requests 9.4 % faster with drafts (k = 1): 16.4 s of that is worth less
    # than the 1.7 s the full model would serve later, so the restart loads the full model directly
    res = overloaded_run({})
    (rl,) = res.stats.reloads
    assert not rl.draft_first and res.stats.pairings == 0
    assert rl.reload_s == pytest.approx(TARGET.load_time())


def test_drafting_that_pays_for_the_delay_loads_the_draft_first_and_pairs() -> None:
    # a better draft model (acceptance 0.8: 12.6 % faster) makes up for the delay
    res = overloaded_run({"agreement": 0.8})
    (rl,) = res.stats.reloads
    assert rl.draft_first and res.stats.pairings >= 1
    assert rl.reload_s == pytest.approx(TARGET.load_time() + DRAFTER.weights_time())
    # the paper's ungated progressive recovery always loads the draft first
    (ungated,) = overloaded_run({"assist_gate": False}).stats.reloads
    assert ungated.draft_first


def test_under_the_outage_boost_the_draft_first_choice_judges_the_boosted_batch() -> None:
    # with the boost (w1 alone: 1.5 x 64 = 96 slots) drafting gains less than on 64: the restart's
    # choice judges the batch the survivor runs once boosted, as the pairing after it does, so it
    # does not load a draft that would then never be paired
    res = overloaded_run({"agreement": 0.8}, boost=1.5)
    (rl,) = res.stats.reloads
    assert not rl.draft_first and res.stats.pairings == 0
    assert rl.reload_s == pytest.approx(TARGET.load_time())
