"""gateway.cluster.placed: every process's command line and addresses come from its place (no process
is started here; tests/chaos run such clusters in network namespaces)."""

from __future__ import annotations

from pathlib import Path

from gateway.cluster.placed import (
    CONTROL_PORT,
    HTTP_PORT,
    Place,
    PlacedGateways,
    PlacedSpec,
    PlacedWorkers,
    placed_config,
    placed_worker_specs,
)


def spec(tmp_path: Path) -> PlacedSpec:
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("x")
    key.write_text("x")
    return PlacedSpec(
        gateways=[Place(["on", "g0"], "10.0.0.1"), Place(["on", "g1"], "10.0.0.2")],
        workers={"w0": Place(["on", "h0"], "10.0.0.3"), "w1": Place(["on", "h1"], "10.0.0.4")},
        token="t" * 32,
        cert=str(cert),
        key=str(key),
        log_dir=str(tmp_path),
    )


def test_gateways_bind_their_places(tmp_path: Path) -> None:
    s = spec(tmp_path)
    config = placed_config(s)
    assert (config.gateway.control_host, config.cluster.hung_restart_grace_s) == ("10.0.0.1", 0.0)
    fleet = PlacedGateways(config, ["--set", "a=1"], s.gateways, tmp_path)
    assert fleet.control_addresses == [f"10.0.0.1:{CONTROL_PORT}", f"10.0.0.2:{CONTROL_PORT}"]
    assert fleet.urls() == [f"http://10.0.0.1:{HTTP_PORT}", f"http://10.0.0.2:{HTTP_PORT}"]
    argv = fleet._argv(fleet.gateways[1])
    assert argv[:2] == ["on", "g1"]
    assert argv[-4:] == ["--set", 'gateway.host="10.0.0.2"', "--set", 'gateway.control_host="10.0.0.2"']
    assert s.token not in " ".join(argv)  # the token travels in the environment only


def test_workers_bind_their_places_and_attach_everywhere(tmp_path: Path) -> None:
    s = spec(tmp_path)
    config = placed_config(s)
    control = ["10.0.0.1:1", "10.0.0.2:1"]
    specs = placed_worker_specs(config, control, s.workers)
    assert [(w.worker_id, w.host, w.control_address, w.more_control_addresses) for w in specs] == [
        ("w0", "10.0.0.3", "10.0.0.1:1", ["10.0.0.2:1"]),
        ("w1", "10.0.0.4", "10.0.0.1:1", ["10.0.0.2:1"]),
    ]
    assert all(w.control_tls_ca == s.cert and w.control_token == s.token for w in specs)
    workers = PlacedWorkers(specs, {w: p.prefix for w, p in s.workers.items()}, tmp_path)
    assert workers.worker_argv(specs[1])[:2] == ["on", "h1"]
    assert workers.worker_argv(specs[1])[-2:] == ["-m", "worker_hooks.engine"]
