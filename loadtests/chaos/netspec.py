"""Network faults in the fault-schedule language (loadtests/faults.py), for hosts in namespaces.

    partition:gw0|w0@5+3          cut gw0 and w0 apart both ways at 5 s, heal at 8 s
    partition:w0>gw@5+3           one way: w0's packets to every gateway are dropped (theirs reach it)
    partition:gw1|all@4+6         gw1 from every other host (workers and the load client)
    loss:all@5+10:pct=10          every host drops 10 % of the packets it sends, 5 s to 15 s
    bw:w1@3+5:rate=2mbit          w1 sends at most 2 Mbit/s (tc tbf)
    delay:all@5+10:ms=25:jitter=25   delay ± jitter (tc netem, or an NFQUEUE delayer where the kernel has no netem)

Grammar: `KIND:HOSTS@SECONDS[+DURATION][:key=value]...`, HOSTS either SIDE (loss, bw, delay) or
SIDE|SIDE / SIDE>SIDE (partition). A SIDE is a comma-separated list of host names (gw0, w1, client)
and groups: `gw` (every gateway), `workers`, `client`, `all` (every host; in a partition, every host
not on the other side). Without +DURATION a fault lasts to the end of the run (then healed).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

NetKind = Literal["partition", "loss", "bw", "delay"]
NET_KINDS: tuple[NetKind, ...] = ("partition", "loss", "bw", "delay")
NET_GRAMMAR = "KIND:HOSTS@SECONDS[+DURATION][:key=value] (partition: A|B both ways, A>B one way)"
GROUPS = ("gw", "workers", "client", "all")
OPTIONS: dict[str, tuple[str, ...]] = {
    "partition": (),
    "loss": ("pct",),
    "bw": ("rate",),
    "delay": ("ms", "jitter"),
}
_NUM = r"(\d+(?:\.\d*)?|\.\d+)"
_WHEN = re.compile(rf"{_NUM}(?:\+{_NUM})?")
_HOST = re.compile(r"[A-Za-z][A-Za-z0-9-]{0,14}")
_RATE = re.compile(r"\d+(?:\.\d+)?(?:bit|kbit|mbit|gbit)")


class NetSpecError(ValueError):
    """A network fault spec that cannot be used; the message quotes it and says why."""


_Bad = Callable[[str], NetSpecError]


@dataclass(frozen=True, slots=True)
class NetFault:
    kind: NetKind
    side_a: tuple[str, ...]  # names and groups as written
    side_b: tuple[str, ...] = ()  # partition only
    one_way: bool = False  # partition A>B: only A's packets to B are dropped
    at: float = 0.0
    duration: float | None = None
    options: tuple[tuple[str, str], ...] = ()
    spec: str = field(default="", compare=False)

    def option(self, key: str) -> str | None:
        return dict(self.options).get(key)

    def __str__(self) -> str:
        hosts = ",".join(self.side_a)
        if self.kind == "partition":
            hosts += (">" if self.one_way else "|") + ",".join(self.side_b)
        s = f"{self.kind}:{hosts}@{_num(self.at)}"
        if self.duration is not None:
            s += f"+{_num(self.duration)}"
        return s + "".join(f":{k}={v}" for k, v in self.options)


def _num(x: float) -> str:
    return repr(x).removesuffix(".0")


def is_net_spec(spec: str) -> bool:
    return spec.strip().partition(":")[0] in NET_KINDS


def parse_net_fault(spec: str) -> NetFault:
    def bad(why: str) -> NetSpecError:
        return NetSpecError(f"network fault spec {spec!r}: {why} (expected {NET_GRAMMAR})")

    parts = spec.strip().split(":")
    if len(parts) < 2:
        raise bad("no ':' between KIND and HOSTS")
    kind, where, opts = parts[0], parts[1], parts[2:]
    if kind not in NET_KINDS:
        raise bad(f"unknown kind {kind!r}; one of {', '.join(NET_KINDS)}")
    hosts, at_sign, when = where.partition("@")
    if not at_sign:
        raise bad("no @SECONDS after the hosts")
    m = _WHEN.fullmatch(when)
    if m is None:
        raise bad(f"{when!r} is not SECONDS[+DURATION] with non-negative decimal numbers")
    at, duration = float(m[1]), (float(m[2]) if m[2] is not None else None)
    if duration is not None and not (math.isfinite(duration) and duration > 0):
        raise bad("the duration must be a positive number of seconds")
    one_way = False
    if kind == "partition":
        sep = "|" if "|" in hosts else ">" if ">" in hosts else None
        if sep is None:
            raise bad("a partition needs two sides: A|B (both ways) or A>B (A's packets to B dropped)")
        a_text, _, b_text = hosts.partition(sep)
        side_a, side_b, one_way = _side(a_text, bad), _side(b_text, bad), sep == ">"
        if "all" in side_a and "all" in side_b:
            raise bad("only one side of a partition can be 'all'")
    else:
        if "|" in hosts or ">" in hosts:
            raise bad(f"{kind} takes one set of hosts, not two sides")
        side_a, side_b = _side(hosts, bad), ()
    options: list[tuple[str, str]] = []
    for opt in opts:
        key, eq, value = opt.partition("=")
        if not eq or key not in OPTIONS[kind]:
            allowed = ", ".join(f"{k}=..." for k in OPTIONS[kind]) or "no options"
            raise bad(f"option {opt!r}: {kind} takes {allowed}")
        if any(k == key for k, _ in options):
            raise bad(f"option {key} is given twice")
        options.append((key, value))
    got = dict(options)
    if kind == "loss":
        pct = _number(got.get("pct"), "pct", bad)
        if not 0 < pct <= 100:
            raise bad(f"pct {pct:g} must be in (0, 100]")
    elif kind == "bw":
        if not _RATE.fullmatch(got.get("rate", "")):
            raise bad("bw needs rate=N with a unit: bit, kbit, mbit or gbit (e.g. rate=2mbit)")
    elif kind == "delay":
        ms = _number(got.get("ms"), "ms", bad)
        jitter = _number(got.get("jitter", "0"), "jitter", bad)
        if not (0 < ms <= 10_000 and 0 <= jitter <= ms):
            raise bad("delay needs 0 < ms <= 10000 and 0 <= jitter <= ms")
    return NetFault(kind, side_a, side_b, one_way, at, duration, tuple(options), spec=spec)


def _side(text: str, bad: _Bad) -> tuple[str, ...]:
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    if not names:
        raise bad("a side names no host")
    for n in names:
        if n not in GROUPS and not _HOST.fullmatch(n):
            raise bad(f"{n!r} is neither a host name nor one of {', '.join(GROUPS)}")
    return names


def _number(text: str | None, key: str, bad: _Bad) -> float:
    try:
        value = float(text) if text is not None else math.nan
    except ValueError:
        raise bad(f"{key} {text!r} is not a number") from None
    if not math.isfinite(value):
        raise bad(f"{key}=N is required")
    return value


def expand(names: Sequence[str], hosts: Sequence[str], *, exclude: Sequence[str] = ()) -> list[str]:
    """Host names of a side: groups expanded against the lab's `hosts`, in lab order. Raises
    NetSpecError for a name the lab does not have."""
    out: set[str] = set()
    for n in names:
        if n == "all":
            out.update(h for h in hosts if h not in exclude)
        elif n == "gw":
            out.update(h for h in hosts if h.startswith("gw"))
        elif n == "workers":
            out.update(h for h in hosts if re.fullmatch(r"w\d+", h))
        elif n in hosts:
            out.add(n)
        else:
            raise NetSpecError(f"no host {n!r} in this lab ({', '.join(hosts)})")
    return [h for h in hosts if h in out]


def check_hosts(faults: Sequence[NetFault], hosts: Sequence[str]) -> None:
    """Every named host must exist, and a partition's two sides must not meet."""
    for f in faults:
        try:
            a = expand(f.side_a, hosts)
            b = expand(f.side_b, hosts, exclude=a if "all" in f.side_b else ())
            a = expand(f.side_a, hosts, exclude=b if "all" in f.side_a else ())
        except NetSpecError as exc:
            raise NetSpecError(f"network fault spec {f.spec or str(f)!r}: {exc}") from None
        if f.kind == "partition" and (set(a) & set(b) or not a or not b):
            raise NetSpecError(f"network fault spec {f.spec or str(f)!r}: its sides overlap or one is empty")
