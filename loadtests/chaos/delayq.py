"""Delay and jitter without sch_netem: a userspace queue that holds each packet a host sends.

Many kernels (this machine's among them) are built without `sch_netem`, the qdisc `tc … netem delay`
needs. Netfilter's NFQUEUE target (xtables, present far more often) hands every matching packet to a
userspace process, which must give a verdict before the kernel sends it on. This process binds one
queue and accepts each packet `ms ± jitter` milliseconds (uniform, clipped at 0) after it arrived, so
with jitter packets may leave out of order, as with netem. netfaults.py starts it inside a host's
namespace, then adds the rule `iptables -I OUTPUT -o eth0 -j NFQUEUE --queue-num N --queue-bypass`;
healing deletes the rule first (packets flow unqueued again), then ends this process, which lets
every packet it still holds go at once.

Only packet metadata is copied to userspace (`COPY_META`), so a held packet costs a few hundred
bytes; the kernel accepts packets unqueued while the queue is full (`fail_open`) or unbound
(`--queue-bypass`), so a slow or dead delayer never turns delay into loss.

    python -m loadtests.chaos.delayq --queue 101 --ms 50 --jitter 50 [--seed 7]

Prints `ready` on stdout once bound. Needs root (CAP_NET_ADMIN) and the `fnfqueue` package (the
`chaos` extra).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import os
import random
import signal
import sys
import threading
import time
from typing import Any

# packets the kernel may hold for us at once (default 1024); past it they pass undelayed (fail_open)
QUEUE_MAXLEN = 20_000
# bytes of buffer per packet in flight to us: metadata only (COPY_META), no payload
PACKET_BUFFER = 1024


class Delayer:
    """Holds packets and accepts each when its time comes (a heap ordered by due time)."""

    def __init__(self, ms: float, jitter_ms: float, rng: random.Random) -> None:
        self.ms = ms
        self.jitter_ms = jitter_ms
        self.rng = rng
        self._heap: list[tuple[float, int, Any]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._stopping = False
        self.held_max = 0

    def delay_s(self) -> float:
        return max(0.0, self.rng.uniform(self.ms - self.jitter_ms, self.ms + self.jitter_ms)) / 1000.0

    def hold(self, packet: Any) -> None:
        due = time.monotonic() + self.delay_s()
        with self._cv:
            heapq.heappush(self._heap, (due, next(self._seq), packet))
            self.held_max = max(self.held_max, len(self._heap))
            if self._heap[0][2] is packet:
                self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()

    def release_loop(self) -> None:
        """Accept packets as they come due; on stop, accept every packet still held, then return."""
        while True:
            with self._cv:
                while not self._stopping and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cv.wait(self._heap[0][0] - time.monotonic() if self._heap else None)
                if self._stopping:
                    due, self._heap = self._heap, []
                else:
                    due = [heapq.heappop(self._heap)]
            for _, _, packet in due:
                _accept(packet)
            if self._stopping:
                return


def _accept(packet: Any) -> None:
    try:
        packet.accept()
    except Exception:  # the connection closed under us: the kernel frees the packet
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtests.chaos.delayq", description=__doc__.split("\n")[0])
    ap.add_argument("--queue", type=int, required=True, help="the NFQUEUE number to bind (0-65535)")
    ap.add_argument("--ms", type=float, required=True, help="mean delay, milliseconds")
    ap.add_argument("--jitter", type=float, default=0.0, help="± this many milliseconds, uniform")
    ap.add_argument("--seed", type=int, default=None, help="the jitter's random seed")
    args = ap.parse_args(argv)
    if not (0 <= args.queue <= 65535 and args.ms >= 0 and args.jitter >= 0):
        ap.error("--queue 0..65535, --ms >= 0, --jitter >= 0")

    import fnfqueue  # the `chaos` extra; imported here so --help works without it

    conn = fnfqueue.Connection(packet_size=PACKET_BUFFER)
    queue = conn.bind(args.queue)
    queue.set_mode(0, fnfqueue.COPY_META)
    queue.fail_open = True
    queue.set_maxlen(QUEUE_MAXLEN)
    delayer = Delayer(args.ms, args.jitter, random.Random(args.seed))
    releaser = threading.Thread(target=delayer.release_loop, name="release", daemon=True)
    releaser.start()

    def stop(*_: object) -> None:
        delayer.stop()
        releaser.join(timeout=5)
        os._exit(0)  # the reader thread of fnfqueue blocks in select(); nothing else to tidy

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print("ready", flush=True)
    while True:
        try:
            for packet in conn:
                delayer.hold(packet)
        except fnfqueue.BufferOverflowException:
            conn.reset()  # the kernel dropped what did not fit in our socket buffer; go on
        else:
            return 0


if __name__ == "__main__":
    sys.exit(main())
