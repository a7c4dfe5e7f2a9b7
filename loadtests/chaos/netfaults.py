"""Network faults fired inside the lab's namespaces: nft for partitions and loss, tc for bandwidth
(tbf), and delay/jitter by tc netem where the kernel has sch_netem, else by a userspace delayer on an
NFQUEUE (delayq.py; the same delay and jitter, `delay_backend()` says which).

Each fault gets its own nft table (`inet lumchaos_f<N>`) in every namespace it touches, with base
chains on the input/output hooks, so healing it deletes exactly that table and overlapping faults
never undo each other. tc faults replace the root qdisc of the host's eth0 and heal by deleting it.
A queued delay is one iptables rule on the host's OUTPUT (inserted first: the newest delay on a host
applies, as with tc) and one delayer process; healing deletes the rule, then ends the process.
"""

from __future__ import annotations

import asyncio
import importlib.util
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from loadtests.chaos.netns import LabError, run
from loadtests.chaos.netspec import NetFault, expand

log = structlog.get_logger("lumen.chaos")

_netem: bool | None = None


class NetFaultUnavailable(RuntimeError):
    """This machine cannot inject that fault (a kernel module or a command is missing)."""


def nft_missing() -> str | None:
    return None if shutil.which("nft") else "the `nft` command (nftables) is not installed"


def netem_available() -> bool:
    """Whether the kernel has sch_netem: a netem qdisc on a scratch namespace's lo (probed once)."""
    global _netem
    if _netem is None:
        ns = f"lumchaos-netem-probe-{id(object())}"
        try:
            run(["ip", "netns", "add", ns])
            rc = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    "lo",
                    "root",
                    "netem",
                    "delay",
                    "1ms",
                ],
                capture_output=True,
                timeout=10,
            ).returncode
            _netem = rc == 0
        finally:
            run(["ip", "netns", "del", ns], check=False)
    return _netem


NETEM_MISSING = "this kernel has no sch_netem (CONFIG_NET_SCH_NETEM): delay and jitter cannot be injected"
# the repository root, the delayer's working directory (`python -m loadtests.chaos.delayq`)
_ROOT = Path(__file__).resolve().parents[2]
DELAYER_READY_TIMEOUT_S = 10.0
_QUEUE_BASE = 100  # NFQUEUE numbers: 100 + the fault's id (each namespace has its own queues)


def _iptables() -> str | None:
    return shutil.which("iptables") or shutil.which("iptables-legacy")


def queue_delay_missing() -> str | None:
    """Why the userspace delayer cannot run here, or None."""
    if _iptables() is None:
        return "the `iptables` command is not installed (NFQUEUE delay needs it)"
    if importlib.util.find_spec("fnfqueue") is None:
        return "the `fnfqueue` package is not installed (the `chaos` extra)"
    return None


def delay_backend() -> str | None:
    """How delay and jitter are injected here: "netem", "nfqueue" (delayq.py), or None."""
    if netem_available():
        return "netem"
    return "nfqueue" if queue_delay_missing() is None else None


def delay_missing() -> str | None:
    if delay_backend() is not None:
        return None
    return f"{NETEM_MISSING}, and no userspace delay either: {queue_delay_missing()}"


@dataclass(frozen=True, slots=True)
class HostAddr:
    ns: str
    addr: str


class NetFaults:
    """Applies and heals network faults on hosts {name: (namespace, address)}."""

    def __init__(self, hosts: Mapping[str, HostAddr]) -> None:
        self.hosts = dict(hosts)
        self.names = list(self.hosts)
        self._applied: dict[int, list[tuple[str, str]]] = {}  # fault id -> (namespace, "nft"|"tc")
        # the tc faults on each namespace's eth0, oldest first: one root qdisc per device, so the
        # newest is installed and healing it puts back the one before
        self._tc: dict[str, list[tuple[int, list[str]]]] = {}
        self._next = 0
        # queued delays: fault id -> [(namespace, iptables rule, delayer process)]
        self._queued: dict[int, list[tuple[str, list[str], subprocess.Popen[str]]]] = {}

    def sides(self, f: NetFault) -> tuple[list[str], list[str]]:
        if f.kind != "partition":
            return expand(f.side_a, self.names), []
        b = expand(f.side_b, self.names, exclude=expand(f.side_a, self.names) if "all" in f.side_b else ())
        a = expand(f.side_a, self.names, exclude=b if "all" in f.side_a else ())
        return a, b

    def apply(self, f: NetFault) -> int:
        """Inject `f`; returns its id for `heal`. Raises NetFaultUnavailable or LabError."""
        fid = self._next
        self._next += 1
        a, b = self.sides(f)
        done: list[tuple[str, str]] = []
        self._applied[fid] = done
        table = f"lumchaos_f{fid}"
        if f.kind in ("partition", "loss") and (why := nft_missing()):
            raise NetFaultUnavailable(why)
        backend = delay_backend() if f.kind == "delay" else None
        if f.kind == "delay" and backend is None:
            raise NetFaultUnavailable(delay_missing() or NETEM_MISSING)
        for name in a:
            ns = self.hosts[name].ns
            if f.kind == "partition":
                peers = "{ " + ", ".join(self.hosts[h].addr for h in b) + " }"
                rules = [("output", f"ip daddr {peers} drop")]
                if not f.one_way:
                    rules.append(("input", f"ip saddr {peers} drop"))
                _nft(ns, table, rules)
                done.append((ns, "nft"))
            elif f.kind == "loss":
                pct = float(f.option("pct") or 0)
                # numgen draws 0..9999: a percentage with two decimals
                _nft(
                    ns,
                    table,
                    [("output", f'oifname "eth0" numgen random mod 10000 < {round(pct * 100)} drop')],
                )
                done.append((ns, "nft"))
            elif backend == "nfqueue":
                self._queue_delay(fid, ns, float(f.option("ms") or 0), float(f.option("jitter") or 0))
            else:
                if f.kind == "bw":
                    qdisc = ["tbf", "rate", f.option("rate") or "", "burst", "32kbit", "latency", "400ms"]
                else:
                    qdisc = ["netem", "delay", f"{f.option('ms') or '0'}ms", f"{f.option('jitter') or '0'}ms"]
                _tc(ns, ["replace", "dev", "eth0", "root", *qdisc])
                self._tc.setdefault(ns, []).append((fid, qdisc))
                done.append((ns, "tc"))
        return fid

    def _queue_delay(self, fid: int, ns: str, ms: float, jitter: float) -> None:
        """Start a delayer in `ns` on queue 100+fid, then send the host's eth0 output through it."""
        queue = str(_QUEUE_BASE + fid)
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-m", "loadtests.chaos.delayq",
             "--queue", queue, "--ms", str(ms), "--jitter", str(jitter), "--seed", str(fid)],
            cwd=_ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        rule = ["OUTPUT", "-o", "eth0", "-j", "NFQUEUE", "--queue-num", queue, "--queue-bypass"]
        self._queued.setdefault(fid, []).append((ns, rule, proc))  # healed (ended) even if not ready
        assert proc.stdout is not None
        try:
            ready = proc.stdout.readline() if _readable(proc, DELAYER_READY_TIMEOUT_S) else ""
        except OSError:
            ready = ""
        if ready.strip() != "ready":
            proc.kill()
            err = proc.communicate(timeout=5)[1]
            raise LabError(f"the delayer in {ns} did not start: {err.strip()[-400:]}")
        run(["ip", "netns", "exec", ns, _iptables() or "iptables", "-w", "-I", *rule])

    def heal(self, fid: int) -> None:
        for ns, rule, proc in self._queued.pop(fid, []):
            run(["ip", "netns", "exec", ns, _iptables() or "iptables", "-w", "-D", *rule], check=False)
            if proc.poll() is None:
                proc.terminate()  # it lets every packet it holds go, then exits
            try:
                proc.communicate(timeout=5)  # also closes its pipes
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate(timeout=5)
        for ns, what in self._applied.pop(fid, []):
            if what == "nft":
                run(
                    ["ip", "netns", "exec", ns, "nft", "delete", "table", "inet", f"lumchaos_f{fid}"],
                    check=False,
                )
            else:
                stack = [x for x in self._tc.get(ns, []) if x[0] != fid]
                self._tc[ns] = stack
                if stack:  # an older tc fault on this host is still on: it comes back
                    _tc(ns, ["replace", "dev", "eth0", "root", *stack[-1][1]])
                else:
                    run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", "eth0", "root"], check=False)

    def heal_all(self) -> None:
        for fid in list(self._applied) + list(self._queued):
            self.heal(fid)


def _readable(proc: subprocess.Popen[str], timeout_s: float) -> bool:
    assert proc.stdout is not None
    return bool(select.select([proc.stdout], [], [], timeout_s)[0])


def _nft(ns: str, table: str, rules: Sequence[tuple[str, str]]) -> None:
    lines = [f"table inet {table} {{"]
    for hook in dict.fromkeys(h for h, _ in rules):
        lines.append(f"  chain {hook} {{ type filter hook {hook} priority 0; policy accept;")
        lines += [f"    {rule}" for h, rule in rules if h == hook]
        lines.append("  }")
    lines.append("}")
    run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input_text="\n".join(lines) + "\n")


def _tc(ns: str, args: Sequence[str]) -> None:
    run(["ip", "netns", "exec", ns, "tc", "qdisc", *args])


class NetFaultRunner:
    """Fires a list of network faults at their times during a load that started at monotonic `t0`,
    heals each after its duration (or at the end). `fired` records each injection and heal like
    loadtests.faults.FaultRunner's records (`t`, `spec`, `kind`, `mode`, `hosts`, `ok`, `error`)."""

    def __init__(self, faults: NetFaults, events: Sequence[NetFault], *, t0: float) -> None:
        self.faults = faults
        self.events = sorted(events, key=lambda e: e.at)
        self.t0 = t0
        self.fired: list[dict[str, Any]] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def run(self) -> None:
        heals: list[asyncio.Task[None]] = []
        try:
            for e in self.events:
                await asyncio.sleep(max(0.0, e.at - self.now()))
                fid = await self._fire(e)
                if fid is not None and e.duration is not None:
                    heals.append(asyncio.create_task(self._heal_later(e, fid)))
            await asyncio.gather(*heals)
        finally:
            for task in heals:
                task.cancel()
            await asyncio.gather(*heals, return_exceptions=True)
            if self.faults._applied:
                self._record(None, "heal-at-end", True, None)
            await asyncio.to_thread(self.faults.heal_all)

    async def _fire(self, e: NetFault) -> int | None:
        a, b = self.faults.sides(e)
        try:
            fid = await asyncio.to_thread(self.faults.apply, e)
        except (NetFaultUnavailable, LabError) as exc:
            self._record(e, "inject", False, str(exc), a, b)
            return None
        self._record(e, "inject", True, None, a, b)
        return fid

    async def _heal_later(self, e: NetFault, fid: int) -> None:
        assert e.duration is not None
        await asyncio.sleep(max(0.0, e.at + e.duration - self.now()))
        await asyncio.to_thread(self.faults.heal, fid)
        self._record(e, "heal", True, None)

    def _record(
        self,
        e: NetFault | None,
        mode: str,
        ok: bool,
        error: str | None,
        a: Sequence[str] = (),
        b: Sequence[str] = (),
    ) -> None:
        rec = {
            "t": round(self.now(), 4),
            "spec": (e.spec or str(e)) if e else "",
            "kind": e.kind if e else "heal",
            "mode": mode,
            "hosts": [list(a), list(b)],
            "ok": ok,
            "error": error,
        }
        self.fired.append(rec)
        if ok:
            log.info("net_fault", **{k: v for k, v in rec.items() if k != "error"})
        else:
            log.warning("net_fault_not_fired", spec=rec["spec"], error=error)
