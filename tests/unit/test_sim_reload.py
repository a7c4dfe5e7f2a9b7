"""Seeded fast reload in the simulator (issue 14): a restart loads its weights from a survivor."""

import json
from pathlib import Path
from typing import Any

import pytest

from gateway.cli import main
from gateway.core.costmodel import CostModel, ReloadSource
from gateway.core.evaluation import mean_metric, outcomes
from gateway.core.modes import policy_for
from gateway.sim.result import Reload, RunResult
from gateway.sim.runner import build_workload, metrics
from gateway.sim.scenario import ScenarioError, parse_scenario
from gateway.sim.simulation import Simulation

COST = CostModel.preset("Qwen3-8B", "H100-80G")  # 16.4 GB, TP 1
DETECT = 0.06


def scenario(
    reload: str = "disk", workers: int = 4, failures: Any = None, draft: Any = None, **cluster: Any
) -> Any:
    return parse_scenario(
        {
            "cluster": {"workers": workers, "model": "Qwen3-8B", "draft_model": "Qwen3-0.6B", **cluster},
            "workload": {"rate": 30.0, "duration_s": 60.0},
            "recovery": {"reload": reload},
            "draft": draft or {},
            "failures": failures or [{"at_s": 20.0, "workers": ["w1"]}],
        }
    )


def run(reload: str, mode: str = "stop_restart", seed: int = 3, **kw: Any) -> tuple[Simulation, RunResult]:
    s = scenario(reload, **kw)
    sim = Simulation(s, policy_for(mode), build_workload(s, seed), seed)
    return sim, sim.run()


def only(result: RunResult) -> Reload:
    (rl,) = result.stats.reloads
    return rl


@pytest.mark.parametrize("mode", ["stop_restart", "lumen"])
def test_a_peer_reload_finishes_the_restart_earlier_than_disk(mode: str) -> None:
    # no cost gate: nothing waits on the survivors at this load, so the gate would skip the draft
    ungated = {"assist_gate": False}
    _, disk = run("disk", mode, draft=ungated)
    sim, peer = run("peer", mode, draft=ungated)
    d, p = only(disk), only(peer)
    assert d.worker == p.worker == "w1" and d.started_s == p.started_s == pytest.approx(20.0 + DETECT)
    assert d.source == "disk" and d.seed is None and d.transfer_s == 0.0
    assert p.source == "peer" and p.seed not in (None, "w1") and p.transfer_s > 0
    assert d.reload_s is not None and p.reload_s is not None and p.reload_s < d.reload_s
    # the seeded reload is the engine start-up plus the weights at the peer bandwidth
    assert p.reload_s == pytest.approx(COST.load_time(source=ReloadSource.PEER))
    assert p.transfer_s == pytest.approx(COST.weights_time(ReloadSource.PEER))
    if mode == "stop_restart":
        assert d.reload_s == pytest.approx(COST.load_time()) and not d.draft_first
    else:
        # progressive recovery from disk: the draft model first; from a peer the full model beats it
        assert d.draft_first and d.draft_ready_s is not None
        assert not p.draft_first and p.draft_ready_s is None
    # the transfer is over and the seed runs at full speed again
    assert (
        not sim.reloads.sending and not sim.reloads.reloading and all(w.send_slow == 1.0 for w in sim.workers)
    )
    for res in (disk, peer):
        o = outcomes(res.records)
        assert o.errors == 0 and o.completed == o.total
    m = metrics(peer, peer)
    assert m["reload_source"] == "peer" and m["reload_s"] == pytest.approx(p.reload_s, abs=0.01)
    assert m["reloads"][0]["seed"] == p.seed


def test_the_seed_is_slowed_while_it_sends() -> None:
    # a slow interconnect makes the transfer long enough to matter (16.4 GB at 1 GB/s: 16.4 s)
    kw = {"peer_bw": 1e9, "peer_load_s": 17.0}
    _, plain = run("peer", **kw)
    slowed_s = parse_scenario(
        {
            "cluster": {"workers": 4, "model": "Qwen3-8B", "draft_model": "Qwen3-0.6B", **kw},
            "workload": {"rate": 30.0, "duration_s": 60.0},
            "recovery": {"reload": "peer", "seed_slowdown": 4.0},
            "failures": [{"at_s": 20.0, "workers": ["w1"]}],
        }
    )
    slowed = Simulation(slowed_s, policy_for("stop_restart"), build_workload(slowed_s, 3), 3).run()
    a, b = only(plain), only(slowed)
    assert a.seed == b.seed and a.transfer_s == b.transfer_s == pytest.approx(16.4)
    assert a.serving_s == b.serving_s == pytest.approx(20.0 + DETECT + 17.0)
    # the seed's requests take longer while it sends four times slower
    assert mean_metric(slowed.records, "tpot") > mean_metric(plain.records, "tpot")  # type: ignore[operator]


def test_a_lost_seed_makes_the_restart_fall_back_to_disk() -> None:
    # two workers: w0 dies, w1 is its only possible seed and dies during the transfer
    kw = {"peer_bw": 4e9}  # transfer 4.1 s: from 40.16 to 44.26
    fail = [{"at_s": 20.0, "workers": ["w0"]}, {"at_s": 42.0, "workers": ["w1"]}]
    sim, res = run("peer", workers=2, failures=fail, **kw)
    first, second = res.stats.reloads
    assert first.worker == "w0" and first.seed == "w1" and first.source == "peer>disk"
    # the transfer began after the engine start-up and ran until w1 died
    assert first.transfer_s == pytest.approx(42.0 - (20.0 + DETECT + 20.0))
    # the weights start over from disk when the transfer breaks; no second engine start-up
    assert first.serving_s == pytest.approx(42.0 + COST.weights_time())
    # w1's own restart finds no survivor to seed from (w0 is still loading): disk
    assert second.worker == "w1" and second.seed is None and second.source == "disk"
    assert second.reload_s == pytest.approx(COST.load_time())
    assert not sim.reloads.sending and not sim.reloads.reloading


def test_a_seed_is_never_shared_and_a_killed_restart_frees_its_seed() -> None:
    # w0 and w1 die together: two restarts, two different seeds (a seed serves one destination)
    both = [{"at_s": 20.0, "workers": ["w0", "w1"]}]
    _, res = run("peer", failures=both)
    a, b = res.stats.reloads
    assert {a.worker, b.worker} == {"w0", "w1"} and a.seed and b.seed and a.seed != b.seed
    assert {a.seed, b.seed} <= {"w2", "w3"}
    # w0 is killed again while loading, mid-transfer: its seed stops sending
    kw = {"peer_bw": 1e9, "peer_load_s": 20.0}  # transfer 16.4 s, from 23.66 to 40.06
    again = [{"at_s": 20.0, "workers": ["w0"]}, {"at_s": 30.0, "workers": ["w0"]}]
    sim, res = run("peer", failures=again, **kw)
    first, second = res.stats.reloads
    assert first.serving_s is None and first.reload_s is None  # never served
    assert second.seed is not None and second.serving_s is not None
    assert not sim.reloads.sending and all(w.send_slow == 1.0 for w in sim.workers)


def test_scenario_keys_and_cli_flag(tmp_path: Path) -> None:
    assert scenario().recovery.reload is ReloadSource.DISK
    assert scenario("peer").recovery.reload is ReloadSource.PEER
    with pytest.raises(ScenarioError, match=r"recovery\.reload"):
        scenario("nvme")
    with pytest.raises(ScenarioError, match="seed_slowdown"):
        parse_scenario(
            {"cluster": {"workers": 2}, "workload": {"rate": 1.0}, "recovery": {"seed_slowdown": 0.5}}
        )
    with pytest.raises(ScenarioError, match="peer_bw"):
        parse_scenario({"cluster": {"workers": 2, "peer_bw": -1.0}, "workload": {"rate": 1.0}})
    p = tmp_path / "tiny.toml"
    p.write_text(
        '[cluster]\nworkers = 3\nmodel = "Qwen3-8B"\ndraft_model = "Qwen3-0.6B"\n'
        "[workload]\nrate = 10.0\nduration_s = 30.0\n"
        '[[failures]]\nat_s = 10.0\nworkers = ["w0"]\n'
    )
    out = tmp_path / "out"
    args = ["sim", "--scenario", str(p), "--out", str(out), "--modes", "stop_restart", "--quiet"]
    assert main([*args, "--no-plots", "--reload", "peer"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    m = summary["modes"]["stop_restart"]
    assert summary["reload"] == "peer" and m["reload_source"] == "peer"
    assert m["reload_s"] == pytest.approx(COST.load_time(source=ReloadSource.PEER), abs=0.01)
    assert "| peer |" in (out / "summary.md").read_text()


@pytest.mark.parametrize(
    "failures",
    [
        [{"at_s": 20.0, "fraction": 0.25}],
        [{"at_s": 20.0, "workers": ["w0"]}, {"at_s": 21.0, "holder_of": "w0"}],
        [{"at_s": 20.0, "workers": ["w0", "w1", "w2", "w3"]}],  # nobody left to seed from
        [{"at_s": 20.0, "kind": "slow", "workers": ["w2"]}, {"at_s": 25.0, "workers": ["w0"]}],
    ],
)
def test_peer_reloads_conserve_every_request(failures: Any) -> None:
    for mode in ("stop_restart", "lumen"):
        sim, res = run("peer", mode, failures=failures)
        o = outcomes(res.records)
        assert o.completed + o.errors == o.total
        assert all(rl.serving_s is not None for rl in res.stats.reloads)
        assert not sim.reloads.sending and not sim.reloads.reloading
        if len(failures[0].get("workers", ())) == 4:
            assert all(rl.source == "disk" for rl in res.stats.reloads)
        else:
            assert any(rl.source.startswith("peer") for rl in res.stats.reloads)


def test_a_draft_first_restart_keeps_the_scenarios_model_load_time() -> None:
    """`model_load_s` 8 s and `draft_load_s` 2 s: a restart that loads its draft first serves 8 s plus
    the draft's own weights after its start (the cost models' rule), not the draft time plus the
    cost model's full weights (which ignored the scenario's 8 s)."""
    draft_weights = CostModel.preset("Qwen3-0.6B", "H100-80G").load_time(engine_startup_s=0.0)
    _, res = run("disk", "lumen", draft={"assist_gate": False}, model_load_s=8.0, draft_load_s=2.0)
    rl = only(res)
    assert rl.draft_first and rl.draft_ready_s == pytest.approx(rl.started_s + 2.0)
    assert rl.reload_s == pytest.approx(8.0 + draft_weights)
    _, plain = run("disk", "stop_restart", model_load_s=8.0, draft_load_s=2.0)
    assert only(plain).reload_s == pytest.approx(8.0)
