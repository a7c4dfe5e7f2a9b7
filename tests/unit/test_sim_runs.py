"""Whole runs: determinism, conservation, every mode on every kind of failure, the CLI."""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from gateway.cli import main
from gateway.core.evaluation import outcomes
from gateway.core.modes import EVALUATION_MODES, MODES, policy_for
from gateway.sim.runner import build_workload, run_scenario
from gateway.sim.scenario import Scenario, parse_scenario
from gateway.sim.simulation import Simulation

FAILURES = {
    "kill": [{"at_s": 20.0, "workers": ["w1"]}],
    "quarter": [{"at_s": 20.0, "fraction": 0.25}],
    "double": [{"at_s": 20.0, "workers": ["w0"]}, {"at_s": 21.0, "holder_of": "w0"}],
    "domain": [{"at_s": 20.0, "domain": "d1"}],
    "gray": [{"at_s": 20.0, "kind": "slow", "workers": ["w2"]}],
}


def small(failures: str, **workload: float) -> Scenario:
    return parse_scenario(
        {
            "cluster": {"workers": 4, "failure_domains": 2, "model": "Qwen3-8B", "draft_model": "Qwen3-0.6B"},
            "workload": {"rate": 30.0, "duration_s": 60.0, **workload},
            "recovery": {"exclude_failure_domain": True},
            "failures": FAILURES[failures],
        },
        name=f"small-{failures}",
    )


@pytest.mark.parametrize(
    "failures",
    # the default run: a kill (failover) and a gray failure (no interruption); the rest in `-m slow`
    [pytest.param(f, marks=() if f in ("kill", "gray") else pytest.mark.slow) for f in sorted(FAILURES)],
)
def test_every_request_completes_or_is_counted_as_failed(failures: str) -> None:
    s = small(failures)
    workload = build_workload(s, 3)
    for mode in MODES:
        res = Simulation(s, policy_for(mode), workload, 3).run()
        o = outcomes(res.records)
        assert o.total == len(workload) and o.completed + o.errors == o.total
        done = [r for r in res.records if not r.error]
        # a completed request received every output token it asked for
        assert sum(r.output_tokens for r in done) == sum(
            int(n) for r, n in zip(res.records, workload.outputs, strict=True) if not r.error
        )
        if failures == "gray" or MODES[mode].failover:
            assert o.errors == 0, mode  # a survivor is always left
        else:
            assert o.errors == o.interrupted > 0
        if failures != "gray":
            assert o.interrupted > 0


def test_same_seed_same_result_and_another_seed_differs() -> None:
    s = small("double")
    a = Simulation(s, policy_for("lumen"), build_workload(s, 7), 7).run()
    b = Simulation(s, policy_for("lumen"), build_workload(s, 7), 7).run()
    c = Simulation(s, policy_for("lumen"), build_workload(s, 8), 8).run()
    assert a.records == b.records and a.stats == b.stats
    assert np.array_equal(a.queue, b.queue) and np.array_equal(a.ckpt_tokens, b.ckpt_tokens)
    assert a.records != c.records


def test_quarter_victims_depend_on_the_seed_not_the_mode() -> None:
    s = replace(small("quarter"), cluster=replace(small("quarter").cluster, workers=16))
    assert s.victims(1) == s.victims(1) != s.victims(2)
    assert len(s.victims(1)[0]) == 4


def test_rack_failure_spares_load_aware_checkpoints() -> None:
    s = small("domain")
    workload = build_workload(s, 1)
    lumen = Simulation(s, policy_for("lumen"), workload, 1).run().stats
    ring = Simulation(s, policy_for("fixed_checkpoint"), workload, 1).run().stats
    # holders outside the failed domain survive it; the ring's successor is in the same domain
    assert lumen.coverage is not None and ring.coverage is not None
    assert lumen.coverage > 0.8 > ring.coverage


def test_run_scenario_summary_has_every_metric() -> None:
    report = run_scenario(small("kill", duration_s=40.0), EVALUATION_MODES, 1)
    summary = report.summary()
    assert len(report.baselines) == 3  # shared by (checkpointing, placement)
    for mode in EVALUATION_MODES:
        m = summary["modes"][mode]
        for key in (
            "ttft_mean_s",
            "tpot_mean_s",
            "recovery_time_s",
            "impact_ttft_mean_s",
            "impact_tpot_mean_s",
            "client_errors",
            "recovery_time_tpot_s",
            "checkpoint_coverage",
            "holder_balance",
            "restores",
            "replays",
            "acceptance_rate",
            "recovery_time_robust_s",
            "recovery_time_windowed_s",
            "excess_ttft_request_s",
            "impact_ttft_x_baseline",
            "ttft_after_failure_s",
        ):
            assert key in m
    assert summary["modes"]["none"]["client_errors"] > 0
    assert summary["modes"]["lumen"]["client_errors"] == 0
    # the failure cost every failover mode request-seconds of TTFT against its no-failure twin
    assert all(summary["modes"][m]["excess_ttft_request_s"] > 0 for m in ("stop_restart", "lumen"))
    # one common window for every mode
    assert len({m["window_s"] for m in summary["modes"].values()}) == 1
    json.dumps(summary, allow_nan=False)


def _scenario_file(tmp_path: Path) -> Path:
    p = tmp_path / "tiny.toml"
    p.write_text(
        '[cluster]\nworkers = 3\nmodel = "Qwen3-8B"\ndraft_model = "Qwen3-0.6B"\n'
        "[workload]\nrate = 20.0\nduration_s = 40.0\n"
        '[[failures]]\nat_s = 15.0\nworkers = ["w0"]\n'
    )
    return p


def test_lumen_sim_writes_summary_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    rc = main(
        [
            "sim",
            "--scenario",
            str(_scenario_file(tmp_path)),
            "--out",
            str(out),
            "--seed",
            "2",
            "--modes",
            "stop_restart,fixed_checkpoint,lumen",
            "--duration",
            "30",
        ]
    )
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert (
        summary["seed"] == 2
        and summary["workers"] == 3
        and set(summary["modes"]) == {"stop_restart", "fixed_checkpoint", "lumen"}
    )
    assert summary["simulated_s"] >= 30 and summary["wall_s"] > 0
    md = (out / "summary.md").read_text()
    assert "| lumen |" in md and "Change vs `stop_restart`" in md and "Change vs `fixed_checkpoint`" in md
    for png in ("ttft.png", "queue.png", "ckpt_load.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert "[" in capsys.readouterr().err  # the progress bar


def test_lumen_tune_writes_grid_heatmap_and_recommendation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tune"
    rc = main(
        [
            "tune",
            "--scenario",
            str(_scenario_file(tmp_path)),
            "--out",
            str(out),
            "--quiet",
            "--theta",
            "0.5,2",
            "--tau",
            "0,512,4096",
            "--rules",
            "threshold,cost",
        ]
    )
    assert rc == 0
    result = json.loads((out / "tune.json").read_text())
    assert len(result["grid"]) == 6 and len(result["cost_rule"]) == 1
    best = result["best"]
    assert best["theta"] in (0.5, 2.0) and best["tau"] in (0, 512, 4096)
    assert 2 <= len(result["margin"]["neighbours"]) <= 3
    assert (out / "heatmap.png").read_bytes()[:4] == b"\x89PNG"
    assert "recommended: theta=" in capsys.readouterr().out


def test_bad_cli_input_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["sim", "--scenario", "paper-4w", "--out", str(tmp_path), "--modes", "lumen,bogus"])
    with pytest.raises(SystemExit) as exc:
        main(["sim", "--scenario", "no-such", "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "no scenario" in capsys.readouterr().err
