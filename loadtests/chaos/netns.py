"""Hosts on one machine: Linux network namespaces joined by veth pairs to one bridge.

A `Lab` makes one namespace per host (`lumchaos-<pid>-<host>`, lo up, `eth0` with 10.77.0.N/24) and
one for the bridge (`lumchaos-<pid>-br`); every veth lives only inside those namespaces (its bridge
end is named after the host, its host end `eth0`), so deleting the namespaces removes everything and
no traffic touches the machine's own interfaces. Cleanup is guaranteed three ways: the context
manager, an atexit hook, and `cleanup_leftovers()`, which removes every `lumchaos-*` namespace whose
creating process (the pid in its name) is gone — after a failed or killed test too — ending the
processes still inside it (they can only be ours).

Needs root and `ip` (iproute2). Processes start inside a host with `ip netns exec` (which execs, so
the pid returned is the process's own) and are ended by that pid.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

PREFIX = "lumchaos-"
SUBNET = "10.77.0"
BRIDGE = "br0"
_MAX_HOSTS = 200


class LabError(RuntimeError):
    """A namespace command failed; the message has the command and its stderr."""


def missing_tools() -> str | None:
    """Why a lab cannot run here (not root, no `ip`), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    return None


def run(argv: Sequence[str], *, input_text: str | None = None, check: bool = True) -> str:
    proc = subprocess.run(list(argv), input=input_text, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise LabError(f"{' '.join(argv)}: exit {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout


def list_namespaces() -> list[str]:
    """Every namespace name `ip netns list` shows (ours or not)."""
    return [line.split()[0] for line in run(["ip", "netns", "list"]).splitlines() if line.strip()]


def ours(owner: int | None = None) -> list[str]:
    """Our namespaces: all `lumchaos-*`, or those a given pid created."""
    names = [n for n in list_namespaces() if n.startswith(PREFIX)]
    if owner is not None:
        names = [n for n in names if n.startswith(f"{PREFIX}{owner}-")]
    return names


def _owner(name: str) -> int | None:
    head = name.removeprefix(PREFIX).partition("-")[0]
    return int(head) if head.isdigit() else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def delete_namespace(name: str) -> None:
    """End the processes inside `name` (by pid: only ours run there), then delete it."""
    pids = run(["ip", "netns", "pids", name], check=False).split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    run(["ip", "netns", "del", name], check=False)


def cleanup_leftovers() -> list[str]:
    """Delete the `lumchaos-*` namespaces whose creator is gone; returns their names."""
    gone = [n for n in ours() if (o := _owner(n)) is None or not _alive(o)]
    for name in gone:
        delete_namespace(name)
    return gone


@dataclass(slots=True)
class Host:
    name: str  # gw0, w1, client ...
    ns: str  # the namespace's name
    addr: str  # its address on the bridge

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *argv]


@dataclass(slots=True)
class Lab:
    """Namespaces for `hosts` (names: letters, digits, `-`, at most 15 characters) on one bridge."""

    hosts: Sequence[str]
    owner: int = field(default_factory=os.getpid)
    by_name: dict[str, Host] = field(default_factory=dict)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    _up: bool = False

    @property
    def bridge_ns(self) -> str:
        return f"{PREFIX}{self.owner}-br"

    def __getitem__(self, name: str) -> Host:
        return self.by_name[name]

    def up(self) -> Lab:
        if why := missing_tools():
            raise LabError(why)
        if len(set(self.hosts)) != len(self.hosts) or len(self.hosts) > _MAX_HOSTS:
            raise LabError(f"host names must be unique and at most {_MAX_HOSTS}: {list(self.hosts)}")
        for h in self.hosts:
            if not (h.replace("-", "").isalnum() and len(h) <= 15 and h != "br"):
                raise LabError(f"host name {h!r}: letters, digits and '-', at most 15 characters, not 'br'")
        cleanup_leftovers()
        atexit.register(self.down)
        self._up = True
        br = self.bridge_ns
        run(["ip", "netns", "add", br])
        run(["ip", "-n", br, "link", "add", BRIDGE, "type", "bridge"])
        run(["ip", "-n", br, "link", "set", BRIDGE, "up"])
        for i, name in enumerate(self.hosts, start=1):
            host = Host(name, f"{PREFIX}{self.owner}-{name}", f"{SUBNET}.{i}")
            run(["ip", "netns", "add", host.ns])
            run(["ip", "-n", host.ns, "link", "set", "lo", "up"])
            run(
                [
                    "ip",
                    "-n",
                    br,
                    "link",
                    "add",
                    "name",
                    name,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "eth0",
                    "netns",
                    host.ns,
                ]
            )
            run(["ip", "-n", br, "link", "set", "dev", name, "master", BRIDGE, "up"])
            run(["ip", "-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", "eth0"])
            run(["ip", "-n", host.ns, "link", "set", "eth0", "up"])
            self.by_name[name] = host
        return self

    def spawn(
        self,
        host: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        log: IO[bytes] | None = None,
        stdout: int | IO[bytes] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start `argv` inside `host`; its pid is the process's own (`ip netns exec` execs)."""
        proc = subprocess.Popen(
            self[host].exec_argv(argv),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=stdout if stdout is not None else (log or subprocess.DEVNULL),
            stderr=log or subprocess.DEVNULL,
        )
        self.procs.append(proc)
        return proc

    def down(self) -> None:
        """End every process we started (by pid), then delete our namespaces. Idempotent."""
        if not self._up:
            return
        self._up = False
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for name in ours(self.owner):
            delete_namespace(name)
        atexit.unregister(self.down)

    def __enter__(self) -> Lab:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()
