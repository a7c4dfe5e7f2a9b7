"""KV checkpoint streaming: GB/s from `CheckpointSender` to a `StoreServer` + `CheckpointStore` vs raw
pyzmq PUSH/PULL with the same frames, over loopback TCP and IPC (DESIGN 4.4, EVALUATION).

    python -m loadtests.bench_kv [--total-mib 256] [--repeats 3] [--frames 64K,256K,1M,4M]

The receiver runs in its own process (spawned), the sender in this one. Raw: a blocking PUSH sends
[small header, frame] with copy=False as fast as it can to a blocking PULL that counts bytes. Lumen:
`send_pages` calls of one frame each (pages of ≤ 64 KiB, payload zero-copy), paced only by the
sender's own queue, into a real store that holds each 32 MiB request until its END. Each figure is
the median of `--repeats` runs, timed at the sender from the first send to the receiver's "all
bytes in". A last row streams single 64 KiB pages grouped into 1 MiB frames (the grouping copy).
Also reported: the caller-side cost of each `send_pages` call (p50/p99 µs). Writes
out/bench_kv.json.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
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

import zmq
import zmq.asyncio

from gateway.protocol.kv import KvHeader
from worker_hooks.kv.receiver import StoreServer
from worker_hooks.kv.sender import CheckpointSender
from worker_hooks.kv.store import CheckpointStore, HoldResult

KiB, MiB = 1 << 10, 1 << 20
PAGE_SIZE = 16  # tokens per page
REQUEST_BYTES = 32 * MiB


def _size(text: str) -> int:
    text = text.strip().upper()
    unit = {"K": KiB, "M": MiB}.get(text[-1], 1)
    return int(text[:-1] if text[-1] in "KM" else text) * unit


def _label(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


# -- receiver process -----------------------------------------------------------------------------
def _raw_receiver(bind_to: str, conn: Connection) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind(bind_to)
    conn.send(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    while (cmd := conn.recv())[0] == "expect":
        got = 0
        while got < cmd[1]:
            got += sock.recv_multipart(copy=False)[1].buffer.nbytes
        conn.send(("done", got))
    sock.close(0)
    ctx.term()


async def _lumen_receiver(bind_to: str, conn: Connection) -> None:
    loop = asyncio.get_running_loop()
    store = CheckpointStore(4 * REQUEST_BYTES)
    target = [0]
    arrived = asyncio.Event()

    def on_hold(header: KvHeader, _result: HoldResult) -> None:
        if server.stats.payload_bytes >= target[0]:
            arrived.set()

    async with StoreServer(store, bind_to, on_hold=on_hold) as server:
        conn.send(server.endpoint)
        while (cmd := await loop.run_in_executor(None, conn.recv))[0] == "expect":
            start = server.stats.payload_bytes
            target[0] = start + cmd[1]
            arrived.clear()
            await arrived.wait()
            conn.send(("done", server.stats.payload_bytes - start))


def receiver_main(mode: str, bind_to: str, conn: Connection) -> None:
    if mode == "raw":
        _raw_receiver(bind_to, conn)
    else:
        asyncio.run(_lumen_receiver(bind_to, conn))


# -- sender side ----------------------------------------------------------------------------------
def _raw_send(endpoint: str, frame: int, total: int, conn: Connection) -> float:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 16)
    sock.connect(endpoint)
    payload, header = bytes(frame), b"h" * 64
    time.sleep(0.05)  # let the connection come up
    conn.send(("expect", total))
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
) -> tuple[float, list[float]]:
    sender = CheckpointSender("bench", 1, frame_bytes=frame, max_lag_bytes=1 << 40)
    pages_per_call = call_bytes // page_bytes
    payload = memoryview(bytes(call_bytes))
    calls_per_request = max(1, REQUEST_BYTES // call_bytes)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, conn.send, ("expect", total))
    sender.send_pages(
        "warmup", [endpoint], 0, list(range(PAGE_SIZE * pages_per_call)), payload, page_size=PAGE_SIZE
    )
    sender.drop("warmup")
    sender.reset_caller_cost()
    t0 = time.perf_counter()
    sent, req = 0, 0
    while sent < total:
        rid = f"r{req}"
        for c in range(calls_per_request):
            # keep the sender's own queue from being the limit, as a steady decode loop would
            while sender.queued_bytes(endpoint) > 64 * MiB:  # noqa: ASYNC110 (polling is the point)
                await asyncio.sleep(0)
            first = c * pages_per_call
            base = (req << 24) + first * PAGE_SIZE
            ids = list(range(base, base + PAGE_SIZE * pages_per_call))
            sender.send_pages(rid, [endpoint], first, ids, payload, page_size=PAGE_SIZE)
            sent += call_bytes
            if sent >= total:
                break
        sender.end(rid)
        req += 1
    await loop.run_in_executor(None, conn.recv)
    elapsed = time.perf_counter() - t0
    cost = sender.caller_cost()
    await sender.close()
    return elapsed, [cost.p50_us, cost.p99_us]


def measure(
    mode: str, transport: str, frame: int, total: int, repeats: int, call_bytes: int, page_bytes: int
) -> dict[str, Any]:
    spawn = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="lumen-kv-") as tmp:
        bind_to = "tcp://127.0.0.1:0" if transport == "tcp" else f"ipc://{tmp}/kv.sock"
        parent, child = spawn.Pipe()
        proc = spawn.Process(target=receiver_main, args=(mode, bind_to, child), daemon=True)
        proc.start()
        endpoint = parent.recv()
        times, costs = [], []
        for _ in range(repeats):
            if mode == "raw":
                times.append(_raw_send(endpoint, frame, total, parent))
            else:
                elapsed, cost = asyncio.run(
                    _lumen_send(endpoint, frame, total, parent, call_bytes, page_bytes)
                )
                times.append(elapsed)
                costs.append(cost)
        parent.send(("stop",))
        proc.join(10)
    med = statistics.median(times)
    out: dict[str, Any] = {"gbps": total / med / 1e9, "seconds": times}
    if costs:
        out["send_pages_p50_us"] = statistics.median(c[0] for c in costs)
        out["send_pages_p99_us"] = statistics.median(c[1] for c in costs)
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
    print(
        f"{'transport':<9} {'frame':>7} {'raw GB/s':>9} {'lumen GB/s':>11} {'ratio':>6} {'send_pages p50/p99 µs':>22}"
    )
    for transport in args.transports.split(","):
        # (frame, bytes per send_pages call, bytes per page, label)
        cases = [(f, f, min(f, 64 * KiB), _label(f)) for f in map(_size, args.frames.split(","))]
        cases.append((MiB, 64 * KiB, 64 * KiB, "64K>1M"))  # single-page calls grouped by the sender
        for frame, call, page, label in cases:
            raw = measure("raw", transport, frame, total, args.repeats, frame, frame)
            lumen = measure("lumen", transport, frame, total, args.repeats, call, page)
            row = {
                "transport": transport,
                "frame": label,
                "frame_bytes": frame,
                "call_bytes": call,
                "page_bytes": page,
                "raw": raw,
                "lumen": lumen,
            }
            rows.append(row)
            print(
                f"{transport:<9} {label:>7} {raw['gbps']:>9.2f} {lumen['gbps']:>11.2f} "
                f"{lumen['gbps'] / raw['gbps']:>6.2f} {lumen['send_pages_p50_us']:>10.1f} / {lumen['send_pages_p99_us']:<8.1f}",
                flush=True,
            )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    report = {
        "command": "python -m loadtests.bench_kv "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit,
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
