"""The simulator's hot modules compiled with mypyc: the same source, ~3× less CPU (issue 17, item 5).

`MODULES` (the event loop, the worker model, the simulated gateway's books and the core policies
they call on every request) are compiled as they are written: no second implementation, and the
same outputs exactly (`scripts/bench_sim.py golden --check`, `tests/unit/test_sim_native.py`).

A build lives in the user's cache (`cache_root()`), in a directory named by a digest of the
compiled modules' sources and the Python it was built for. Edit one of them and the digest
changes: the old build no longer applies, and `activate` refuses a build whose recorded digest
is not the current one, so a stale compiled module can never run in place of the source.

- `lumen native build` (`build`) compiles them (mypyc and a C compiler: `pip install lumen[native]`).
- A process started with `LUMEN_SIM_NATIVE=<build>/lib` loads those modules from the build: the
  simulator package (`gateway/sim/__init__.py`) calls `activate` when it is imported, which such a
  process does before anything imports them. `lumen sim` and `lumen tune` restart themselves that way
  when a build for the current sources exists (`--native`; as `LUMEN`, which imports the simulator
  before `gateway.cli`), and the processes of `--jobs` inherit it.

Only simulator processes use a build; the live gateway and the workers never import the simulator.
This module is imported by `gateway/sim/__init__.py` before anything else and so uses the standard
library alone.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

ENV = "LUMEN_SIM_NATIVE"  # a build's lib directory: the process loads MODULES from it
CACHE_ENV = "LUMEN_NATIVE_CACHE"  # where builds are kept (default: the user's cache directory)
GROUP = "lumen_native"  # mypyc's shared library for the group: `lumen_native__mypyc`
STAMP = "LUMEN_NATIVE_DIGEST"  # in a build's lib directory: the digest it was built from
# the Python arguments of `lumen ARGS...` on a build: the simulator package (and with it the build,
# when ENV is set) is imported before `gateway.cli`, which imports compiled `gateway.core` modules
LUMEN: tuple[str, ...] = ("-c", "import sys, gateway.sim; from gateway.cli import main; sys.exit(main())")

# Compiled together. Every module here is imported only through the build once it is active, so
# none of them may be subclassed by an interpreted module (mypyc's native classes cannot be), and
# every value passed to them must have its declared type (compiled code checks at run time).
MODULES: tuple[str, ...] = (
    "gateway.core.health",
    "gateway.core.types",
    "gateway.core.load",
    "gateway.core.holders",
    "gateway.core.router",
    "gateway.core.loadshape",
    "gateway.core.outage",
    "gateway.sim.events",
    "gateway.sim.request",
    "gateway.sim.batch",
    "gateway.sim.stepcost",
    "gateway.sim.worker",
    "gateway.sim.seen",
    "gateway.sim.outage",
    "gateway.sim.coordinator",
    "gateway.sim.simulation",
)

_PACKAGE_ROOT = Path(__file__).resolve().parent.parent.parent  # the directory holding `gateway`
_EXT = importlib.machinery.EXTENSION_SUFFIXES[0]


class NativeError(RuntimeError):
    """A build could not be made (no mypyc, no compiler, a compile error: the message says which)."""


def source_path(module: str) -> Path:
    return _PACKAGE_ROOT.joinpath(*module.split(".")).with_suffix(".py")


def source_digest() -> str:
    """SHA-256 of the compiled modules' sources and the interpreter they are built for."""
    h = hashlib.sha256()
    h.update(f"{sys.implementation.cache_tag} {_EXT} {sys.version}".encode())
    for module in MODULES:
        h.update(module.encode() + b"\0")
        h.update(source_path(module).read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lumen" / "native"


def build_dir(digest: str | None = None) -> Path:
    return cache_root() / (digest or source_digest())[:20]


def ready() -> Path | None:
    """The lib directory of a finished build for the current sources, or None."""
    lib = build_dir() / "lib"
    stamp = lib / STAMP
    if stamp.is_file() and stamp.read_text().strip() == source_digest():
        return lib
    return None


def active() -> bool:
    """Whether this process runs the compiled modules."""
    return any(isinstance(f, _Finder) for f in sys.meta_path)


class _Finder:
    """Finds MODULES (and the group's shared library) in a build's lib directory."""

    def __init__(self, lib: Path) -> None:
        self.lib = lib
        self.names = frozenset((*MODULES, f"{GROUP}__mypyc"))

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.names:
            return None
        file = self.lib.joinpath(*fullname.split(".")).with_name(fullname.rpartition(".")[2] + _EXT)
        if not file.is_file():
            raise ImportError(f"{fullname}: missing from the native build at {self.lib} (rebuild it)")
        return importlib.util.spec_from_file_location(fullname, file)


def activate(lib: str | os.PathLike[str]) -> bool:
    """Load MODULES from the build at `lib` in this process, if it was built from the current
    sources and none of them is imported yet; else warn and leave the process interpreted."""
    lib = Path(lib)
    stamp = lib / STAMP
    why = ""
    if not stamp.is_file():
        why = f"no native build at {lib}"
    elif stamp.read_text().strip() != source_digest():
        why = f"the native build at {lib} is of other sources (rebuild: lumen native build)"
    elif loaded := [m for m in MODULES if m in sys.modules]:
        why = f"{loaded[0]} is already imported"
    if why:
        warnings.warn(f"{ENV}: {why}; the simulator runs interpreted", RuntimeWarning, stacklevel=2)
        return False
    if not active():
        sys.meta_path.insert(0, _Finder(lib))
    return True


def compiled(module: ModuleType) -> bool:
    """Whether `module` was loaded from a native build."""
    return (getattr(module, "__file__", "") or "").endswith(_EXT)


# the build script, run in a child process (setuptools' `build_ext`, mypyc's `mypycify`)
_SETUP = """
import sys
from mypyc.build import mypycify
from setuptools import setup
paths, target = sys.argv[1].split(","), sys.argv[2]
# (mypy options may go with the paths: an installed Lumen has no pyproject.toml beside it)
setup(
    name="lumen-native",
    ext_modules=mypycify(
        ["--ignore-missing-imports", *paths], opt_level="3", group_name={group!r}, target_dir=target
    ),
    script_args=sys.argv[3:],
)
"""


def build(progress: Callable[[str], None] = lambda line: None, force: bool = False) -> Path:
    """Compile MODULES into the cache (a minute or two on 2 cores) and return the lib directory.

    Built in a scratch directory, checked by importing every module from it in a child process,
    then moved into place: a failed or interrupted build leaves nothing a later run would load."""
    digest = source_digest()
    out = build_dir(digest)
    if not force and (lib := ready()) is not None:
        progress(f"up to date: {lib}")
        return lib
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise NativeError(f"cannot write the build cache {out.parent} ({exc}; set {CACHE_ENV})") from exc
    if importlib.util.find_spec("mypyc") is None or importlib.util.find_spec("setuptools") is None:
        raise NativeError("mypyc and setuptools are needed to build: pip install 'lumen[native]'")
    if not (os.environ.get("CC") or sysconfig.get_config_var("CC") or shutil.which("cc")):
        raise NativeError("no C compiler found (set CC)")
    scratch = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        lib = scratch / "lib"
        paths = ",".join(str(source_path(m).relative_to(_PACKAGE_ROOT)) for m in MODULES)
        argv = [sys.executable, "-c", _SETUP.format(group=GROUP), paths, str(scratch / "c")]
        argv += ["build_ext", "--build-lib", str(lib), "--build-temp", str(scratch / "tmp")]
        env = {**os.environ, "MYPY_CACHE_DIR": str(scratch / "mypy-cache")}
        env.pop(ENV, None)
        progress(f"compiling {len(MODULES)} modules with mypyc into {out} ...")
        log = scratch / "build.log"
        with log.open("w") as f:
            done = subprocess.run(argv, cwd=_PACKAGE_ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-25:])
            raise NativeError(f"mypyc build failed (exit {done.returncode}); the end of its log:\n{tail}")
        (lib / STAMP).write_text(digest + "\n")
        progress("checking the build ...")
        check = (
            "import sys, gateway.sim.native as n, gateway.sim.simulation as s; sys.exit(not n.compiled(s))"
        )
        env = {**os.environ, ENV: str(lib)}
        checked = subprocess.run(
            [sys.executable, "-W", "error::RuntimeWarning", "-c", check],
            env=env,
            capture_output=True,
            text=True,
        )
        if checked.returncode != 0:
            raise NativeError(f"the build does not load: {checked.stderr.strip()[-2000:]}")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(scratch, out)
        for stale in ("c", "tmp", "mypy-cache"):  # keep only what is loaded, and the log
            shutil.rmtree(out / stale, ignore_errors=True)
        progress(f"built: {out / 'lib'}")
        return out / "lib"
    finally:
        if scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)


def status() -> str:
    lib = ready()
    if active():
        return f"active in this process ({os.environ.get(ENV, '?')})"
    if lib is not None:
        return f"built for the current sources: {lib}"
    return f"not built for the current sources (lumen native build; cache: {cache_root()})"


def clean() -> int:
    """Remove every build but the current sources' one; returns how many were removed."""
    root, keep, n = cache_root(), build_dir().name, 0
    if root.is_dir():
        for d in root.iterdir():
            if d.is_dir() and d.name != keep:
                shutil.rmtree(d, ignore_errors=True)
                n += 1
    return n


def restart(lib: Path, argv: Sequence[str]) -> None:
    """Replace this process by `argv` (a Python command line) run on the build at `lib`."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv], {**os.environ, ENV: str(lib)})
