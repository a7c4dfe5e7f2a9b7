"""Scenario files: every shipped one loads; bad ones are refused with the key named."""

from pathlib import Path
from typing import Any

import pytest

from gateway.sim.scenario import ScenarioError, load_scenario, parse_scenario, scenario_names

EXPECTED = {
    "paper-4w",
    "paper-8w",
    "holder-double",
    "rack",
    "gray",
    *(f"scale-{n}" for n in (4, 8, 16, 32, 64)),
}


def test_every_evaluation_scenario_is_shipped_and_loads() -> None:
    assert set(scenario_names()) >= EXPECTED
    for name in scenario_names():
        s = load_scenario(name)
        assert s.name == name
        assert s.failures, name
        assert s.workload.source == "trace" or s.rate > 0


def test_scale_scenarios_kill_a_quarter_at_the_same_per_worker_rate() -> None:
    rates = {load_scenario(f"scale-{n}").rate / n for n in (4, 8, 16, 32, 64)}
    assert len(rates) == 1
    assert load_scenario("scale-64").failures[0].fraction == 0.25


def test_domains_are_contiguous_blocks() -> None:
    s = parse_scenario({"cluster": {"workers": 16, "failure_domains": 4}, "workload": {"rate": 1.0}})
    assert [s.domain_of(i) for i in range(16)] == [f"d{i // 4}" for i in range(16)]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"cluster": {"workerz": 4}}, "cluster.workerz: unknown key"),
        ({"cluster": {"workers": "4"}}, "cluster.workers: must be an integer"),
        ({"cluster": {"model": "GPT-5"}}, "cluster.model"),
        ({"workload": {"rate": 0.0}}, "rate"),
        ({"workload": {"rate": 1.0, "source": "csv"}}, "workload.source"),
        ({"workload": {"rate": 1.0}, "failures": [{"at_s": 1.0}]}, "exactly one of"),
        ({"workload": {"rate": 1.0}, "failures": [{"workers": ["w9"]}]}, "unknown worker"),
        ({"workload": {"rate": 1.0}, "failures": [{"domain": "d7"}]}, "unknown domain"),
        ({"workload": {"rate": 1.0}, "failures": {"workers": ["w0"]}}, "array of tables"),
        ({"workload": {"rate": 1.0}, "draft": {"agreement": 1.5}}, "draft.agreement"),
        ({"workload": {"rate": 1.0}, "recovery": {"theta": -1.0}}, "recovery.theta: must be a finite number >= 0"),
        ({"workload": {"rate": 1.0}, "recovery": {"theta_mode": "rel"}}, "recovery.theta_mode: must be one of"),
        ({"workload": {"rate": 1.0}, "recovery": {"replicas": 3}}, "recovery.replicas: must be 1 or 2"),
    ],
)
def test_bad_scenarios_name_the_key(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        parse_scenario(data)


def test_unknown_scenario_lists_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="paper-4w"):
        load_scenario("no-such-scenario")
    p = tmp_path / "x.toml"
    p.write_text("[cluster\nworkers = 2")
    with pytest.raises(ScenarioError, match=r"x\.toml"):
        load_scenario(str(p))
