"""The harness itself: faults take effect and heal, and nothing of a lab outlives its creator."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from loadtests.chaos.netfaults import HostAddr, NetFaults, delay_missing
from loadtests.chaos.netns import Lab, cleanup_leftovers, ours, run
from loadtests.chaos.netspec import parse_net_fault

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(60)]

SERVER = (
    "import socket; s = socket.create_server(('{addr}', 7000)); [s.accept()[0].close() for _ in iter(int, 1)]"
)


def reaches(lab: Lab, src: str, dst: str) -> bool:
    code = f"import socket; socket.create_connection(('{lab[dst].addr}', 7000), timeout=0.5).close()"
    return (
        subprocess.run(lab[src].exec_argv([sys.executable, "-c", code]), capture_output=True).returncode == 0
    )


def test_partitions_cut_and_heal() -> None:
    with Lab(["a", "b", "c"]) as lab:
        for h in ("a", "b", "c"):
            lab.spawn(h, [sys.executable, "-c", SERVER.format(addr=lab[h].addr)], env=os.environ)
        deadline = time.monotonic() + 10
        while not (reaches(lab, "a", "b") and reaches(lab, "b", "c") and reaches(lab, "c", "a")):
            assert time.monotonic() < deadline, "the servers did not come up"
        nf = NetFaults({h: HostAddr(lab[h].ns, lab[h].addr) for h in ("a", "b", "c")})
        both = nf.apply(parse_net_fault("partition:a|b@0"))
        assert not reaches(lab, "a", "b") and not reaches(lab, "b", "a")
        assert reaches(lab, "a", "c") and reaches(lab, "b", "c")
        nf.heal(both)
        assert reaches(lab, "a", "b") and reaches(lab, "b", "a")
        # one way: a's packets to b are dropped, so a's connections to b fail; b's SYN reaches a but
        # a's answer is dropped too (TCP needs both ways): only c is unaffected
        one = nf.apply(parse_net_fault("partition:a>b@0"))
        out = run(["ip", "netns", "exec", lab["a"].ns, "nft", "list", "ruleset"])
        assert "daddr" in out and "saddr" not in out
        assert not reaches(lab, "a", "b") and reaches(lab, "c", "b")
        nf.heal(one)
        assert run(["ip", "netns", "exec", lab["a"].ns, "nft", "list", "ruleset"]).strip() == ""
    assert ours() == []


def test_loss_and_bandwidth_rules_are_installed_and_removed() -> None:
    with Lab(["a", "b"]) as lab:
        nf = NetFaults({h: HostAddr(lab[h].ns, lab[h].addr) for h in ("a", "b")})
        loss = nf.apply(parse_net_fault("loss:all@0:pct=12.5"))
        rules = run(["ip", "netns", "exec", lab["b"].ns, "nft", "list", "ruleset"])
        assert "numgen random mod 10000 < 1250 drop" in rules
        bw = nf.apply(parse_net_fault("bw:a@0:rate=2mbit"))
        assert "tbf" in run(["ip", "netns", "exec", lab["a"].ns, "tc", "qdisc", "show", "dev", "eth0"])
        wider = nf.apply(parse_net_fault("bw:a@0:rate=5mbit"))  # one root qdisc: the newest is on
        assert "5Mbit" in run(["ip", "netns", "exec", lab["a"].ns, "tc", "qdisc", "show", "dev", "eth0"])
        nf.heal(wider)  # ... and healing it puts the older one back
        assert "2Mbit" in run(["ip", "netns", "exec", lab["a"].ns, "tc", "qdisc", "show", "dev", "eth0"])
        nf.heal(loss)
        nf.heal(bw)
        assert run(["ip", "netns", "exec", lab["b"].ns, "nft", "list", "ruleset"]).strip() == ""
        assert "tbf" not in run(["ip", "netns", "exec", lab["a"].ns, "tc", "qdisc", "show", "dev", "eth0"])
    assert ours() == []


ECHO = (
    "import socket; s = socket.create_server(('{addr}', 7001))\n"
    "while True:\n"
    "    c = s.accept()[0]\n"
    "    while (d := c.recv(64)): c.sendall(d)\n"
    "    c.close()"
)
RTTS = (
    "import socket, statistics, time\n"
    "c = socket.create_connection(('{addr}', 7001), timeout=5)\n"
    "c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n"
    "r = []\n"
    "for _ in range(30):\n"
    "    t = time.perf_counter(); c.sendall(b'x'); c.recv(8); r.append((time.perf_counter() - t) * 1000)\n"
    "print(min(r), statistics.median(r), max(r))"
)


def rtts_ms(lab: Lab, src: str, dst: str) -> tuple[float, float, float]:
    out = subprocess.run(
        lab[src].exec_argv([sys.executable, "-c", RTTS.format(addr=lab[dst].addr)]),
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    lo, med, hi = map(float, out.split())
    return lo, med, hi


@pytest.mark.skipif(bool(delay_missing()), reason=delay_missing() or "")
def test_delay_and_jitter_take_effect_and_heal() -> None:
    """40 ± 20 ms on a's packets (tc netem, or the NFQUEUE delayer): a's round trips to b take 20-60 ms
    more, spread by the jitter; healed, they are back to a loopback-like bridge's (well under 20 ms)."""
    with Lab(["a", "b"]) as lab:
        lab.spawn("b", [sys.executable, "-c", ECHO.format(addr=lab["b"].addr)], env=os.environ)
        deadline = time.monotonic() + 10
        while subprocess.run(
            lab["a"].exec_argv([sys.executable, "-c", RTTS.format(addr=lab["b"].addr)]), capture_output=True
        ).returncode:
            assert time.monotonic() < deadline, "the echo server did not come up"
        nf = NetFaults({h: HostAddr(lab[h].ns, lab[h].addr) for h in ("a", "b")})
        assert rtts_ms(lab, "a", "b")[1] < 15
        fid = nf.apply(parse_net_fault("delay:a@0:ms=40:jitter=20"))
        lo, med, hi = rtts_ms(lab, "a", "b")
        assert lo >= 19 and 30 <= med <= 60 and hi - lo >= 10, (lo, med, hi)
        nf.heal(fid)
        assert rtts_ms(lab, "a", "b")[1] < 15
        assert run(["ip", "netns", "exec", lab["a"].ns, "iptables", "-S", "OUTPUT"]).count("NFQUEUE") == 0
    assert ours() == []


def test_a_killed_creator_leaves_nothing_after_cleanup() -> None:
    """A lab whose process was killed -9 (no context manager, no atexit) is removed by the next
    cleanup, processes inside it included."""
    code = (
        "import sys; import os; from loadtests.chaos.netns import Lab; lab = Lab(['x', 'y']).up(); "
        "lab.spawn('x', ['sleep', '120'], env=os.environ); print('up', flush=True); sys.stdin.read()"
    )
    with subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    ) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == b"up"
            left = ours(proc.pid)
            assert len(left) == 3, left  # the bridge's namespace and two hosts
            inside = run(["ip", "netns", "pids", f"lumchaos-{proc.pid}-x"]).split()
            assert inside
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    assert set(left) <= set(cleanup_leftovers())
    assert ours(proc.pid) == []
    for pid in inside:
        assert not _running(int(pid)), f"process {pid} of the killed lab still runs"


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
