"""Workloads: the conv-fitted length generator, arrival processes, the trace reader."""

from pathlib import Path

import numpy as np
import pytest

from gateway.sim.workload import (
    CONV_INPUT,
    CONV_OUTPUT,
    LengthFit,
    Workload,
    arrival_times,
    rate_of,
    read_trace,
    synthetic,
)

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "AzureLLMInferenceTrace_conv.csv"


@pytest.mark.parametrize(
    ("fit", "targets"), [(CONV_INPUT, (1020, 2734, 4142)), (CONV_OUTPUT, (129, 424, 601))]
)
def test_lengths_match_the_conv_trace_quantiles(fit: LengthFit, targets: tuple[int, int, int]) -> None:
    x = fit.sample(np.random.default_rng(0), 200_000)
    got = np.percentile(x, [50, 90, 99])
    assert got == pytest.approx(targets, rel=0.03)
    assert x.min() >= fit.lo and x.max() <= fit.hi


def test_means_are_close_to_the_trace() -> None:
    rng = np.random.default_rng(1)
    assert CONV_INPUT.sample(rng, 200_000).mean() == pytest.approx(1155, rel=0.08)
    assert CONV_OUTPUT.sample(rng, 200_000).mean() == pytest.approx(211, rel=0.08)


@pytest.mark.parametrize("cv", [1.0, 3.0])
def test_arrival_rate_and_burstiness(cv: float) -> None:
    t = arrival_times(np.random.default_rng(2), 50.0, 2000.0, cv)
    gaps = np.diff(t)
    assert len(t) / 2000.0 == pytest.approx(50.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)
    assert t.min() >= 0 and t.max() < 2000.0 and np.all(gaps >= 0)


def test_synthetic_is_a_function_of_the_seed() -> None:
    a = synthetic(np.random.default_rng(5), 10.0, 60.0)
    b = synthetic(np.random.default_rng(5), 10.0, 60.0)
    c = synthetic(np.random.default_rng(6), 10.0, 60.0)
    assert np.array_equal(a.arrivals, b.arrivals) and np.array_equal(a.prompts, b.prompts)
    assert not np.array_equal(a.arrivals, c.arrivals)
    assert len(a.head(30.0)) == int(np.sum(a.arrivals < 30.0))


def test_trace_reader_on_a_small_file(tmp_path: Path) -> None:
    p = tmp_path / "t.csv"
    p.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
        "2023-11-16 18:15:47.0000000,10,0\n"
    )
    w = read_trace(p, speedup=2.0)
    assert w.arrivals.tolist() == pytest.approx([0.0, (47.0 - 46.68059) / 2, (50.995169 - 46.68059) / 2])
    assert w.prompts.tolist() == [374, 10, 396] and w.outputs.tolist() == [44, 1, 109]
    (tmp_path / "bad.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nnot a time,1,2\n")
    with pytest.raises(ValueError, match=r"bad\.csv:2"):
        read_trace(tmp_path / "bad.csv")


def test_workload_validates() -> None:
    with pytest.raises(ValueError):
        Workload(np.array([1.0, 0.5]), np.array([1, 1]), np.array([1, 1]))
    with pytest.raises(ValueError):
        Workload(np.array([0.0]), np.array([0]), np.array([1]))


@pytest.mark.skipif(
    not TRACE.exists(), reason="the Azure conv trace is not checked out beside the repository"
)
def test_the_azure_conv_trace() -> None:
    w = read_trace(TRACE)
    assert len(w) == 19366
    assert 58 * 60 < w.arrivals[-1] < 59 * 60
    assert rate_of(w) == pytest.approx(5.53, rel=0.01)
    assert np.percentile(w.prompts, 50) == 1020
