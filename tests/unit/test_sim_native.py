"""The simulator's native build (gateway/sim/native.py): keyed by its sources, never stale, opt-in.

The fast tests here use no compiler: they check what decides whether a build is loaded. The slow
test builds the modules for real (mypyc and cc, ~40 s on 2 cores) and checks that a run on them
gives exactly the interpreted run's outputs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.sim import native

REPO = Path(__file__).resolve().parents[2]


def _fake_build(lib: Path, digest: str) -> None:
    lib.mkdir(parents=True)
    (lib / native.STAMP).write_text(digest + "\n")


def test_the_digest_follows_every_compiled_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = native.source_digest()
    root = tmp_path / "src"
    for module in native.MODULES:
        dst = root.joinpath(*module.split(".")).with_suffix(".py")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(native.source_path(module), dst)
    monkeypatch.setattr(native, "_PACKAGE_ROOT", root)
    assert native.source_digest() == before  # the same sources
    worker = root / "gateway" / "sim" / "worker.py"
    worker.write_text(worker.read_text() + "\n# an edit\n")
    assert native.source_digest() != before


def test_activation_refuses_a_missing_or_stale_build_and_loaded_modules(tmp_path: Path) -> None:
    finders = list(sys.meta_path)
    with pytest.warns(RuntimeWarning, match="no native build"):
        assert not native.activate(tmp_path / "nothing")
    stale = tmp_path / "stale"
    _fake_build(stale, "0" * 64)
    with pytest.warns(RuntimeWarning, match="other sources"):
        assert not native.activate(stale)
    current = tmp_path / "current"
    _fake_build(current, native.source_digest())
    import gateway.sim.simulation  # noqa: F401  (this process runs them interpreted already)

    with pytest.warns(RuntimeWarning, match="already imported"):
        assert not native.activate(current)
    assert sys.meta_path == finders and not native.active()


def test_ready_finds_only_the_current_sources_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    assert native.ready() is None and "not built" in native.status()
    _fake_build(tmp_path / "old" / "lib", "1" * 64)
    _fake_build(native.build_dir() / "lib", native.source_digest())
    assert native.ready() == native.build_dir() / "lib"
    assert native.clean() == 1 and native.ready() is not None


def test_a_fresh_process_loads_exactly_the_compiled_set_from_a_build(tmp_path: Path) -> None:
    """The finder maps the compiled modules (and nothing else) to the build; a module missing from
    it is an ImportError, never a silent fall-back to its source."""
    lib = tmp_path / "lib"
    _fake_build(lib, native.source_digest())
    code = (
        "import importlib.util, gateway.sim.native as n\n"
        "try:\n    import gateway.sim.batch\nexcept ImportError as e:\n    print('ERR', e)\n"
        "other = importlib.util.find_spec('gateway.core.dispatch').origin\n"
        "print(other.endswith('dispatch.py'), n.active())\n"
    )
    env = {**os.environ, native.ENV: str(lib), "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "ERR gateway.sim.batch: missing from the native build" in out.stdout
    assert out.stdout.strip().endswith("True True")


def test_a_command_called_as_a_function_never_restarts_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`main([...])` (tests, embedding) runs interpreted in its own process even with a build ready."""
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    _fake_build(native.build_dir() / "lib", native.source_digest())

    def no_exec(*a: object) -> None:
        raise AssertionError("restarted")

    monkeypatch.setattr(os, "execve", no_exec)
    out = tmp_path / "out"
    args = ["sim", "--scenario", "paper-4w", "--out", str(out), "--duration", "20", "--modes", "lumen"]
    assert main([*args, "--no-plots", "--native", "auto"]) == 0
    assert json.loads((out / "summary.json").read_text())["modes"]


def test_native_on_without_mypyc_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    real = native.importlib.util.find_spec
    monkeypatch.setattr(
        native.importlib.util, "find_spec", lambda name, *a: None if name == "mypyc" else real(name, *a)
    )
    args = ["sim", "--scenario", "paper-4w", "--out", str(tmp_path / "o"), "--native", "on", "--no-plots"]
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    assert "pip install 'lumen[native]'" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_native_build_gives_the_interpreted_outputs_exactly(tmp_path: Path) -> None:
    """Build for real into a scratch cache, then fingerprint short runs of every failure kind,
    reload source and placement (scripts/bench_sim.py golden) interpreted and compiled."""
    env = {**os.environ, native.CACHE_ENV: str(tmp_path / "cache"), "PYTHONPATH": str(REPO)}
    env.pop(native.ENV, None)
    build = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "native", "build"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    cases = "paper-4w-s7-peer,holder-double,rack,gray,scale-16-peer"
    bench = [sys.executable, str(REPO / "scripts" / "bench_sim.py")]
    ref = tmp_path / "ref"
    plain = subprocess.run(
        [*bench, "golden", "--out", str(ref), "--only", cases],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    fast = subprocess.run(
        [*bench, "--native", "golden", "--check", str(ref), "--only", cases],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert fast.returncode == 0, fast.stdout + fast.stderr[-3000:]
    assert fast.stdout.count(" same ") == 5, fast.stdout
    speed = subprocess.run(
        [*bench, "--native", "speed", "--scenario", "paper-4w", "--minutes", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert "[compiled modules]" in speed.stdout, speed.stdout + speed.stderr


def test_an_unwritable_cache_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(native.CACHE_ENV, str(blocker / "cache"))
    with pytest.raises(native.NativeError, match="cannot write the build cache"):
        native.build()
