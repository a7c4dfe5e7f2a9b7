"""KV checkpoint streaming: GB/s from `CheckpointSender` into a `StoreServer` + `CheckpointStore` vs raw
pyzmq PUSH/PULL with the same frames, over loopback TCP and IPC (DESIGN 4.4, EVALUATION.md).

    python -m loadtests.bench_kv [--total-mib 256] [--repeats 3] [--frames 64K,256K,1M,4M]

The receivers run in their own (spawned) processes, the sender in this one; each figure is the median
of `--repeats` runs of `--total-mib`, timed at the sender from the first send to the receiver's "all
bytes in", with the modes' runs interleaved so drift on a shared machine hits them alike. Three
receivers side by side, same frames:

- raw: blocking PUSH sends [64 B header, frame] with copy=False; a blocking PULL counts and drops.
- raw+hold: the same, but the PULL keeps every frame until 32 MiB have arrived (as a store holds a
  request until its END): the cost of landing bytes in fresh memory, which any holder pays.
- lumen: `send_pages` calls of one frame each (pages of at most 64 KiB, payload zero-copy), END every
  32 MiB, into a real store. The producer waits 0.2 ms whenever the sender's own queue exceeds
  64 MiB, as a decode loop that keeps stepping would.

A last row per transport streams single-page 64 KiB calls that the sender groups into 1 MiB frames
(the grouping copy happens in the sender's task). Also reported: the caller-side cost of each
`send_pages` call, p50/p99 µs. Writes out/bench_kv.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import logging
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import structlog
import zmq

from gateway.protocol.kv import KvHeader
from gateway.protocol.planes import PLAINTEXT
from worker_hooks.kv.receiver import StoreServer
from worker_hooks.kv.sender import CheckpointSender
from worker_hooks.kv.store import CheckpointStore, HoldResult

KiB, MiB = 1 << 10, 1 << 20
PAGE_SIZE = 16  # tokens per page
REQUEST_BYTES = 32 * MiB  # held until END
PACE_QUEUE_BYTES = 64 * MiB
PACE_S = 0.0002
MODES = ("raw", "raw+hold", "lumen")


def _size(text: str) -> int:
    text = text.strip().upper()
    return int(text[:-1]) * {"K": KiB, "M": MiB}[text[-1]] if text[-1] in "KM" else int(text)


def _label(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


# -- receiver process: bind, report the endpoint, then per run: "expect" -> "ready" ... "done" -----
def _raw_receiver(bind_to: str, conn: Connection, hold: bool) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind(bind_to)
    conn.send(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    kept: list[memoryview] = []
    while (cmd := conn.recv())[0] == "expect":
        conn.send(("ready",))
        got = held = 0
        while got < cmd[1]:
            buf = sock.recv_multipart(copy=False)[1].buffer
            got += buf.nbytes
            if hold:
                kept.append(buf)
                held += buf.nbytes
                if held >= REQUEST_BYTES:
                    kept.clear()
                    held = 0
        kept.clear()
        conn.send(("done", got))
    sock.close(0)
    ctx.term()


async def _lumen_receiver(bind_to: str, conn: Connection) -> None:
    loop = asyncio.get_running_loop()
    target = [0]
    arrived = asyncio.Event()

    def on_hold(_header: KvHeader, _result: HoldResult) -> None:
        if server.stats.payload_bytes >= target[0]:
            arrived.set()

    # the plane's own cost without CURVE (production encrypts: docs/design.md 4.4 gives that cost)
    async with StoreServer(
        CheckpointStore(4 * REQUEST_BYTES), bind_to, auth=PLAINTEXT, on_hold=on_hold
    ) as server:
        conn.send(server.endpoint)
        while (cmd := await loop.run_in_executor(None, conn.recv))[0] == "expect":
            start = server.stats.payload_bytes
            target[0] = start + cmd[1]
            arrived.clear()
            conn.send(("ready",))  # the sender starts only now, so `start` counts none of its bytes
            await arrived.wait()
            conn.send(("done", server.stats.payload_bytes - start))


def receiver_main(mode: str, bind_to: str, conn: Connection) -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if mode == "lumen":
        asyncio.run(_lumen_receiver(bind_to, conn))
    else:
        _raw_receiver(bind_to, conn, hold=mode == "raw+hold")


# -- sender side ----------------------------------------------------------------------------------
def _raw_send(endpoint: str, frame: int, total: int, conn: Connection) -> float:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 16)
    sock.connect(endpoint)
    payload, header = bytes(frame), b"h" * 64
    time.sleep(0.05)  # let the connection come up
    conn.send(("expect", total))
    conn.recv()
    t0 = time.perf_counter()
    for _ in range(total // frame):
        sock.send_multipart([header, payload], copy=False)
    conn.recv()
    elapsed = time.perf_counter() - t0
    sock.close(0)
    ctx.term()
    return elapsed


async def _lumen_send(
    endpoint: str, frame: int, total: int, conn: Connection, call_bytes: int, page_bytes: int
) -> tuple[float, tuple[float, float]]:
    loop = asyncio.get_running_loop()
    sender = CheckpointSender("bench", 1, auth=PLAINTEXT, frame_bytes=frame, max_lag_bytes=1 << 40)
    pages_per_call = call_bytes // page_bytes
    payload = memoryview(bytes(call_bytes))
    # the first call opens the socket and its task (a one-off cost); then let it connect
    sender.send_pages(
        "warmup", [endpoint], 0, list(range(PAGE_SIZE * pages_per_call)), payload, page_size=PAGE_SIZE
    )
    sender.drop("warmup")
    await asyncio.sleep(0.05)
    sender.reset_caller_cost()
    await loop.run_in_executor(None, conn.send, ("expect", total))
    await loop.run_in_executor(None, conn.recv)
    t0 = time.perf_counter()
    sent = req = 0
    while sent < total:
        rid = f"r{req}"
        for c in range(max(1, REQUEST_BYTES // call_bytes)):
            while sender.queued_bytes(endpoint) > PACE_QUEUE_BYTES:  # noqa: ASYNC110 (a stepping producer)
                await asyncio.sleep(PACE_S)
            first = c * pages_per_call
            base = (req << 24) + first * PAGE_SIZE  # distinct token ids: no dedupe between requests
            sender.send_pages(
                rid,
                [endpoint],
                first,
                range(base, base + PAGE_SIZE * pages_per_call),
                payload,
                page_size=PAGE_SIZE,
            )
            sent += call_bytes
            if sent >= total:
                break
        sender.end(rid)
        req += 1
    await loop.run_in_executor(None, conn.recv)
    elapsed = time.perf_counter() - t0
    cost = sender.caller_cost()
    await sender.close()
    return elapsed, (cost.p50_us, cost.p99_us)


def measure(transport: str, frame: int, call: int, page: int, total: int, repeats: int) -> dict[str, Any]:
    """All modes side by side: one receiver process per mode, runs interleaved mode by mode."""
    spawn = mp.get_context("spawn")
    times: dict[str, list[float]] = {m: [] for m in MODES}
    costs: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory(prefix="lumen-kv-") as tmp:
        receivers = {}
        for m in MODES:
            bind_to = "tcp://127.0.0.1:0" if transport == "tcp" else f"ipc://{tmp}/{MODES.index(m)}.sock"
            parent, child = spawn.Pipe()
            proc = spawn.Process(target=receiver_main, args=(m, bind_to, child), daemon=True)
            proc.start()
            receivers[m] = (proc, parent, parent.recv())
        for _ in range(repeats):
            for m, (_, conn, endpoint) in receivers.items():
                if m == "lumen":
                    elapsed, cost = asyncio.run(_lumen_send(endpoint, frame, total, conn, call, page))
                    costs.append(cost)
                else:
                    elapsed = _raw_send(endpoint, frame, total, conn)
                times[m].append(elapsed)
        for proc, conn, _ in receivers.values():
            conn.send(("stop",))
            proc.join(10)
    out: dict[str, Any] = {
        m: {"gbps": total / statistics.median(t) / 1e9, "seconds": t} for m, t in times.items()
    }
    out["lumen"]["send_pages_p50_us"] = statistics.median(c[0] for c in costs)
    out["lumen"]["send_pages_p99_us"] = statistics.median(c[1] for c in costs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--total-mib", type=int, default=256, help="bytes streamed per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--frames", default="64K,256K,1M,4M")
    ap.add_argument("--transports", default="tcp,ipc")
    ap.add_argument("--out", default="out/bench_kv.json")
    args = ap.parse_args()
    total = args.total_mib * MiB
    rows: list[dict[str, Any]] = []
    head = f"{'transport':<9} {'frame':>7} {'raw':>6} {'raw+hold':>9} {'lumen':>6}  {'lumen/raw':>9} {'lumen/hold':>10}  {'send_pages p50/p99 µs':>21}"
    print("GB/s, median of", args.repeats, "runs of", args.total_mib, "MiB")
    print(head)
    for transport in args.transports.split(","):
        # (frame bytes, bytes per send_pages call, bytes per page, label)
        cases = [(f, f, min(f, 64 * KiB), _label(f)) for f in map(_size, args.frames.split(","))]
        cases.append((MiB, 64 * KiB, 64 * KiB, "64K>1M"))
        for frame, call, page, label in cases:
            res = measure(transport, frame, call, page, total, args.repeats)
            raw, hold, lumen = (res[m]["gbps"] for m in MODES)
            rows.append(
                {
                    "transport": transport,
                    "frame": label,
                    "frame_bytes": frame,
                    "call_bytes": call,
                    "page_bytes": page,
                    **res,
                }
            )
            p50, p99 = res["lumen"]["send_pages_p50_us"], res["lumen"]["send_pages_p99_us"]
            print(
                f"{transport:<9} {label:>7} {raw:>6.2f} {hold:>9.2f} {lumen:>6.2f}  {lumen / raw:>9.2f} "
                f"{lumen / hold:>10.2f}  {p50:>9.1f} / {p99:<9.1f}",
                flush=True,
            )
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    report = {
        "command": "python -m loadtests.bench_kv "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit.strip(),
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "zmq": {"libzmq": zmq.zmq_version(), "pyzmq": zmq.__version__},
        "total_bytes_per_run": total,
        "repeats": args.repeats,
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
