"""Fences that outlive the gateway (gateway/server/workers/fences.py): what a killed gateway fenced, its
restarted process refuses; what it saw end while shutting down, it does not; the file stays small and
survives a torn write."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import ConfigError
from gateway.core.health import WorkerState
from gateway.protocol import control_pb2 as pb
from gateway.server.workers import fences as fences_mod
from gateway.server.workers.fences import LEDGER_FILE, FenceLedger
from gateway.server.workers.monitor import AttachRefused, LoadMonitor


def hello(wid: str, inc: int) -> pb.Hello:
    return pb.Hello(
        protocol_version=1, worker_id=wid, incarnation=inc, http_url=f"http://{wid}", phase=pb.SERVING
    )


def monitor(state: Path) -> LoadMonitor:
    return LoadMonitor(
        clock=lambda: 0.0, heartbeat_interval_s=0.05, heartbeat_misses=4, fences=FenceLedger(state)
    )


def test_a_restarted_gateway_refuses_what_it_fenced_and_admits_the_rest(tmp_path: Path) -> None:
    first = monitor(tmp_path)
    for wid, inc in (("w0", 10), ("w1", 20), ("w2", 30)):
        first.attach(hello(wid, inc))
    first.report_data_failure("w1", 20, "connection reset")  # fenced (a partition, say)
    first.remove("w2")  # removed by an operator: that incarnation is fenced too
    # the process is killed here: nothing is closed or flushed beyond what record() did
    again = monitor(tmp_path)
    with pytest.raises(AttachRefused, match="not newer than 20"):
        again.attach(hello("w1", 20))
    with pytest.raises(AttachRefused, match="not newer than 30"):
        again.attach(hello("w2", 30))
    assert again.attach(hello("w0", 10)).incarnation == 10  # never fenced: admitted as before
    assert again.attach(hello("w1", 21)).incarnation == 21  # reset: a new incarnation
    assert again.attach(hello("w2", 31)).incarnation == 31  # removal is not forever, only its incarnation


def test_without_a_state_dir_a_restart_forgets_as_before(tmp_path: Path) -> None:
    first = LoadMonitor(clock=lambda: 0.0, heartbeat_interval_s=0.05, heartbeat_misses=4)
    first.attach(hello("w1", 20))
    first.report_data_failure("w1", 20, "connection reset")
    again = LoadMonitor(clock=lambda: 0.0, heartbeat_interval_s=0.05, heartbeat_misses=4)
    assert again.attach(hello("w1", 20)).incarnation == 20


def test_streams_ending_during_shutdown_fence_nobody(tmp_path: Path) -> None:
    first = monitor(tmp_path)
    rec = first.attach(hello("w0", 10))
    assert first.fences is not None
    first.fences.close()  # Gateway.stop() does this first
    first.detach(rec, "control stream ended")
    assert rec.state is WorkerState.FAILED  # in this process, as before
    assert monitor(tmp_path).attach(hello("w0", 10)).incarnation == 10


def test_the_file_keeps_one_line_per_worker_after_compaction(tmp_path: Path) -> None:
    ledger = FenceLedger(tmp_path)
    for inc in range(1, 200):
        ledger.record("w0", inc)
        ledger.record("w1", inc * 2)
    ledger.record("w0", 5)  # older than what is fenced: nothing written
    lines = (tmp_path / LEDGER_FILE).read_text().splitlines()
    assert len(lines) <= fences_mod.COMPACT_MIN_LINES + 1
    assert FenceLedger(tmp_path).fences == {"w0": 199, "w1": 398}
    assert len((tmp_path / LEDGER_FILE).read_text().splitlines()) == 2  # compacted at start


def test_a_torn_or_foreign_line_is_skipped_not_fatal(tmp_path: Path) -> None:
    FenceLedger(tmp_path).record("w0", 7)
    with (tmp_path / LEDGER_FILE).open("ab") as f:
        f.write(b'{"worker": "w9", "incarnation": 3, "at_unix_s": 1.0, "v": 99}\n')  # a newer format
        f.write(b'{"worker": "w1", "incarn')  # the process died mid-write
    assert FenceLedger(tmp_path).fences == {"w0": 7}


def test_the_oldest_fences_are_forgotten_past_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fences_mod, "MAX_WORKERS", 3)
    ledger = FenceLedger(tmp_path)
    for i in range(5):
        ledger.record(f"w{i}", 1)
    ledger.record("w2", 2)  # fenced again: now the most recent
    assert list(ledger.fences) == ["w3", "w4", "w2"]
    assert FenceLedger(tmp_path).fences == {"w3": 1, "w4": 1, "w2": 2}


def test_an_unusable_state_dir_is_a_config_error_naming_the_key(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match=r"gateway\.state_dir"):
        FenceLedger(blocker / "state")


def test_a_fence_beyond_any_incarnation_is_skipped_not_a_lockout_for_good(tmp_path: Path) -> None:
    """Issue 29: one ledger line with incarnation 2**64 - 1 (corrupt or hostile) used to refuse every
    future incarnation of that worker; lines out of bounds are skipped, the others kept."""
    import time

    now_us = time.time_ns() // 1000
    lines = [
        f'{{"v":1,"worker":"w0","incarnation":{2**64 - 1},"at_unix_s":0}}',
        f'{{"v":1,"worker":"w1","incarnation":{now_us - 5},"at_unix_s":0}}',
        '{"v":1,"worker":"' + "x" * 5000 + '","incarnation":1,"at_unix_s":0}',
    ]
    (tmp_path / LEDGER_FILE).write_text("\n".join(lines) + "\n")
    m = monitor(tmp_path)
    m.attach(hello("w0", now_us))  # a new incarnation of w0 is admitted
    with pytest.raises(AttachRefused):
        m.attach(hello("w1", now_us - 5))  # the sane fence still holds
    assert set(FenceLedger(tmp_path).fences) <= {"w0", "w1"}
