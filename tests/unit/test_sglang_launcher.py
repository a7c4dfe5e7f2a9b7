"""How SGLang servers are launched: the flags Lumen adds, the testing hook, GPU groups per server."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cluster.fleet_run import sglang_checkpoints
from gateway.cluster.sglang import AgentSpec, Checkpoints, SGLangLaunch, agent_specs, gpu_groups
from gateway.config import load_config
from worker_hooks.sglang.__main__ import parse
from worker_hooks.sglang.agent_config import SidecarConfig
from worker_hooks.sglang.launcher import (
    LAUNCHER_ENV,
    PRIORITY_FLAGS,
    WEIGHTS_GROUP_PORT_DELTA,
    LaunchError,
    launcher_prefix,
    lumen_storage_config,
    remote_instance_args,
    seeded_command,
    server_args,
    server_command,
    sglang_installed,
    tp_of,
    weights_group_ports,
    with_headroom,
)
from worker_hooks.sglang.storage_layout import options_from_extra_config

URL = "http://127.0.0.1:30000"


def test_the_flags_lumen_needs_are_added_when_missing() -> None:
    assert server_args(URL, ["--model-path", "m"]) == [
        "--model-path", "m", "--host", "127.0.0.1", "--port", "30000",
        "--sampling-backend", "pytorch", "--enable-deterministic-inference",
        "--enable-priority-scheduling", "--schedule-low-priority-values-first",
        "--disable-priority-preemption",
    ]  # fmt: skip


def test_flags_already_given_are_kept_once() -> None:
    args = ["--port=30000", "--host", "127.0.0.1", "--sampling-backend", "pytorch"]
    assert server_args(URL, [*args, "--enable-deterministic-inference"]) == [
        *args,
        "--enable-deterministic-inference",
        *PRIORITY_FLAGS,
    ]


@pytest.mark.parametrize(
    "chosen",
    [
        ["--schedule-policy", "lpm"],  # a policy of the operator's: no priority order
        ["--enable-priority-scheduling"],  # priority scheduling as the operator set it up
        ["--schedule-policy=fcfs", "--enable-priority-scheduling", "--schedule-low-priority-values-first"],
    ],
)
def test_a_queue_order_chosen_in_the_launch_arguments_is_left_as_given(chosen: list[str]) -> None:
    """The gateway reads what the server runs with from /server_info (gateway/server/workers/
    server_info.py) and sends priorities only where they order the queue as Lumen's do."""
    out = server_args(URL, chosen)
    assert out[: len(chosen)] == chosen
    assert not set(PRIORITY_FLAGS) & set(out[len(chosen) :])


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--port", "30001"], "--port 30001"),
        (["--host=0.0.0.0"], "--host 0.0.0.0"),
        (["--sampling-backend", "flashinfer"], "--sampling-backend pytorch"),
    ],
)
def test_launch_arguments_that_contradict_lumen_are_refused(args: list[str], needle: str) -> None:
    with pytest.raises(LaunchError, match=needle):
        server_args(URL, args)


@pytest.mark.parametrize("url", ["http://127.0.0.1", "http://127.0.0.1:0", "https://h:1", "127.0.0.1:30000"])
def test_the_url_needs_http_and_a_fixed_port(url: str) -> None:
    with pytest.raises(LaunchError, match="--url"):
        server_args(url, [])


def test_the_launcher_is_sglangs_unless_the_testing_hook_names_another() -> None:
    hook = {LAUNCHER_ENV: "python -m tests.e2e.sglang_launch_shim --x 'a b'"}
    assert launcher_prefix(hook) == ["python", "-m", "tests.e2e.sglang_launch_shim", "--x", "a b"]
    assert server_command(URL, [], hook)[:5] == launcher_prefix(hook) and "--port" in server_command(
        URL, [], hook
    )
    if sglang_installed():
        assert launcher_prefix({}) == [sys.executable, "-m", "sglang.launch_server"]
    else:
        with pytest.raises(LaunchError, match=r"pip install 'lumen\[sglang\]'"):
            launcher_prefix({})


def test_gpu_groups_are_consecutive_tp_sized_and_must_fit() -> None:
    gpus = ("0", "1", "2", "3", "4")
    assert gpu_groups(gpus, 2, None) == [("0", "1"), ("2", "3")]
    assert gpu_groups(gpus, 1, 3) == [("0",), ("1",), ("2",)]
    with pytest.raises(ValueError, match="need 6 GPUs; 5 visible"):
        gpu_groups(gpus, 2, 3)
    with pytest.raises(ValueError, match="need 2 GPUs; 0 visible"):
        gpu_groups((), 2, None)


def test_each_agent_launches_one_server_on_its_own_gpus() -> None:
    launch = SGLangLaunch(model="/m", tp=2, extra=("--mem-fraction-static", "0.8"), gpus=("0", "1", "2", "3"))
    specs = agent_specs(launch, "127.0.0.1:5000", default_workers=7, failure_domains=2)
    assert [(s.worker_id, s.gpus) for s in specs] == [("w0", ("0", "1")), ("w1", ("2", "3"))]
    argv = list(specs[1].argv)
    i = argv.index("--")
    assert argv[i + 1 :] == ["--model-path", "/m", "--tp-size", "2", "--mem-fraction-static", "0.8"]
    agent = dict(zip(argv[:i:2], argv[1:i:2], strict=False))
    assert agent["--url"] == specs[1].url and agent["--gateway"] == "127.0.0.1:5000"
    assert (agent["--id"], agent["--failure-domain"]) == ("w1", "d1") and "--launch" in argv[:i]
    # no GPUs known (a stand-in launcher): the asked number of agents, devices left alone
    bare = agent_specs(SGLangLaunch(model="m", workers=3), "h:1", default_workers=7, restart=False)
    assert [s.gpus for s in bare] == [None] * 3 and all("--no-restart" in s.argv for s in bare)
    assert len({s.url for s in bare}) == 3


def test_agents_wait_for_a_seed_only_where_the_gateway_names_one() -> None:
    """engine.reload = "disk" (the default): the gateway names no seed, so a relaunch does not wait the
    agent's --seed-wait-s for one; "peer": the agent's own default wait."""
    launch = SGLangLaunch(model="m", workers=1)
    [disk] = agent_specs(launch, "h:1", default_workers=1)
    [peer] = agent_specs(launch, "h:1", default_workers=1, peer_reload=True)
    head = list(disk.argv[: disk.argv.index("--")])
    assert head[head.index("--seed-wait-s") + 1] == "0"
    assert "--seed-wait-s" not in peer.argv[: peer.argv.index("--")]


def server_tail(spec: AgentSpec) -> list[str]:
    """The launch_server arguments an agent is given (after its `--`)."""
    return list(spec.argv[spec.argv.index("--") + 1 :])


def test_in_a_mode_with_checkpoints_each_server_runs_lumens_storage_backend_under_its_own_id() -> None:
    ckpt = Checkpoints(budget_bytes=8 << 30, page_size=64)
    specs = agent_specs(SGLangLaunch(model="m", workers=3), "h:1", checkpoints=ckpt, default_workers=7)
    tails = [list(s.argv[s.argv.index("--") + 1 :]) for s in specs]
    options = [
        options_from_extra_config(json.loads(t[t.index("--hicache-storage-backend-extra-config") + 1]))
        for t in tails
    ]
    assert [o.worker_id for o in options] == ["w0", "w1", "w2"]
    assert len({o.holder_endpoint for o in options}) == 3 and all(
        o.holder_budget_bytes == 8 << 30 for o in options
    )
    for t in tails:
        assert "--enable-hierarchical-cache" in t and t[t.index("--page-size") + 1] == "64"
        assert t[t.index("--hicache-storage-backend") + 1] == "dynamic"
        assert lumen_storage_config(t)["worker_id"] in ("w0", "w1", "w2")  # what the agent reads back
    # the user's own backend, or page size, is left as given
    own = ("--hicache-storage-backend", "file", "--page-size", "32")
    [spec] = agent_specs(
        SGLangLaunch(model="m", workers=1, extra=own), "h:1", checkpoints=ckpt, default_workers=1
    )
    assert "--enable-hierarchical-cache" not in spec.argv and server_tail(spec).count("--page-size") == 1
    [spec] = agent_specs(
        SGLangLaunch(model="m", workers=1, extra=("--page-size", "32")),
        "h:1",
        checkpoints=ckpt,
        default_workers=1,
    )
    assert server_tail(spec).count("--page-size") == 1 and "--hicache-storage-backend" in spec.argv


@pytest.mark.parametrize(("mode", "enabled", "want"), [("lumen", True, True), ("fixed_checkpoint", True, True),
    ("stop_restart", True, False), ("lumen", False, False)])  # fmt: skip
def test_the_cluster_adds_checkpoints_only_where_the_mode_writes_them(
    mode: str, enabled: bool, want: bool
) -> None:
    cfg = load_config(None, {"recovery.mode": mode, "checkpoint.enabled": enabled})
    got = sglang_checkpoints(cfg)
    assert (got is not None) == want
    if got is not None:
        assert (got.budget_bytes, got.page_size) == (cfg.checkpoint.budget_bytes, cfg.engine.page_size)


# -- seeded reload: SGLang's remote-instance flags ----------------------------------------------------


def test_a_seeded_launch_names_the_seed_and_one_group_port_per_tp_rank() -> None:
    assert remote_instance_args("http://10.0.0.2:30000", [30500, 30501], 2) == [
        "--load-format", "remote_instance",
        "--remote-instance-weight-loader-seed-instance-ip", "10.0.0.2",
        "--remote-instance-weight-loader-seed-instance-service-port", "30000",
        "--remote-instance-weight-loader-send-weights-group-ports", "[30500,30501]",
        "--remote-instance-weight-loader-backend", "nccl",
    ]  # fmt: skip
    # extra ports (a list sized for a larger TP) are cut to one per rank
    assert "[7,8]" in remote_instance_args("http://h:1", [7, 8, 9], 2)


@pytest.mark.parametrize(
    ("seed_url", "ports", "tp", "needle"),
    [
        ("http://h", [1], 1, "seed url"),
        ("h:30000", [1], 1, "seed url"),
        ("http://h:1", [5], 2, "1 weight-transfer group port"),
        ("http://h:1", [0], 1, "out of range"),
        ("http://h:1", [70000], 1, "out of range"),
    ],
)
def test_seeded_launch_settings_sglang_would_ignore_are_refused(
    seed_url: str, ports: list[int], tp: int, needle: str
) -> None:
    """SGLang quietly loads from storage when the settings are incomplete: refuse them here instead."""
    with pytest.raises(LaunchError, match=needle):
        remote_instance_args(seed_url, ports, tp)


def test_the_seeded_command_replaces_any_load_format_of_its_own() -> None:
    disk = server_command(URL, ["--model-path", "m", "--load-format=dummy"], {LAUNCHER_ENV: "launch"})
    seeded = seeded_command(
        [*disk, "--remote-instance-weight-loader-seed-instance-ip", "old"], "http://10.0.0.9:31000", [1], 1
    )
    assert seeded[: seeded.index("--load-format")] == [a for a in disk if a != "--load-format=dummy"]
    assert seeded.count("--load-format") == 1 and "old" not in seeded and "--load-format=dummy" not in seeded
    assert seeded[seeded.index("--remote-instance-weight-loader-seed-instance-ip") + 1] == "10.0.0.9"


def test_group_ports_default_to_the_servers_own_port_plus_a_delta_per_rank() -> None:
    assert weights_group_ports(30000, 1) == [30000 + WEIGHTS_GROUP_PORT_DELTA]
    assert weights_group_ports(30000, 4) == [30500, 30501, 30502, 30503]
    assert weights_group_ports(65500, 2) == [64998, 64999]  # below the port near the top
    cfg = SidecarConfig(worker_id="s", url="http://127.0.0.1:30000", gateways=("g:1",), tp=2)
    assert cfg.group_ports() == [30500, 30501]
    given = SidecarConfig(
        worker_id="s", url="http://127.0.0.1:30000", gateways=("g:1",), tp=2, weights_group_ports=(9, 10, 11)
    )
    assert given.group_ports() == [9, 10]
    with pytest.raises(ValueError, match="one per TP rank"):
        SidecarConfig(worker_id="s", url="http://h:1", gateways=("g:1",), tp=2, weights_group_ports=(9,))


@pytest.mark.parametrize(
    ("args", "tp"),
    [([], 1), (["--tp-size", "4"], 4), (["--tp=2"], 2), (["--tensor-parallel-size", "8"], 8)],
)
def test_the_tp_comes_from_the_launch_arguments(args: list[str], tp: int) -> None:
    assert tp_of(["--model-path", "m", *args]) == tp


def test_a_bad_tp_is_refused() -> None:
    with pytest.raises(LaunchError, match="--tp-size x"):
        tp_of(["--tp-size", "x"])
    with pytest.raises(LaunchError, match=">= 1"):
        tp_of(["--tp-size", "0"])


def test_the_agents_seed_options() -> None:
    seed = ["--weights-group-ports", "31000,31001", "--seed-wait-s", "0"]
    args, tail = parse(["--url", URL, "--gateway", "g:1", "--launch", *seed, "--", "--tp-size", "2"])
    assert args.weights_group_ports == (31000, 31001) and args.seed_wait_s == 0 and tail == ["--tp-size", "2"]
    args, _ = parse(["--url", URL, "--gateway", "g:1"])
    assert (args.seed_wait_s, args.seed_timeout_s, args.weights_group_ports) == (2.0, 300.0, None)
    with pytest.raises(SystemExit):
        parse(["--url", URL, "--gateway", "g:1", "--weights-group-ports", "a,b"])


def test_the_holder_store_of_the_storage_config_is_read_from_the_launch_args() -> None:
    from worker_hooks.sglang.launcher import lumen_storage_config

    extra = '{"backend_name": "lumen", "lumen": {"holder_endpoint": "tcp://10.0.0.1:5600", "holder_budget_bytes": 8}}'
    args = ["--model-path", "m", "--hicache-storage-backend-extra-config", extra]
    assert lumen_storage_config(args) == {"holder_endpoint": "tcp://10.0.0.1:5600", "holder_budget_bytes": 8}
    assert lumen_storage_config(["--model-path", "m"]) == {}
    with pytest.raises(ValueError, match="not JSON"):
        lumen_storage_config(["--hicache-storage-backend-extra-config", "{nope"])


@pytest.mark.parametrize(
    ("args", "headroom", "out", "held"),
    [
        (["--max-running-requests", "64"], 1.5, ["--max-running-requests", "96"], 64),
        (["--max-running-requests=5", "--tp", "2"], 1.5, ["--tp", "2", "--max-running-requests", "8"], 5),
        (["--max-running-requests", "64"], 1.0, ["--max-running-requests", "64"], 0),  # no room: not held
        (["--tp", "2"], 1.5, ["--tp", "2"], 0),  # SGLang sizes its own batch: nothing to scale
    ],
)
def test_a_launched_server_gets_room_for_the_outage_boost_and_the_gateway_holds_its_batch(
    args: list[str], headroom: float, out: list[str], held: int
) -> None:
    assert with_headroom(args, headroom) == (out, held)


@pytest.mark.parametrize("value", ["many", "0"])
def test_a_batch_that_is_not_a_positive_integer_is_refused(value: str) -> None:
    with pytest.raises(LaunchError, match="--max-running-requests"):
        with_headroom(["--max-running-requests", value], 1.5)


def test_the_agents_held_batch_options() -> None:
    args, _ = parse(["--url", URL, "--gateway", "g:1", "--held-batch", "64"])
    assert args.held_batch == 64 and args.outage_headroom == 1.5
    args, _ = parse(["--url", URL, "--gateway", "g:1"])
    assert args.held_batch is None
    with pytest.raises(SystemExit):
        parse(["--url", URL, "--gateway", "g:1", "--held-batch", "0"])


# a server started by the agent's launcher under uvloop (the agent's loop), with a Python after-fork hook
# registered first: the hook must not run in the child (issue 27: a relaunched real server died with
# SIGSEGV 2 ms after the fork, Python's after-fork code running in the child of a process whose gRPC
# threads were busy). uvloop's own subprocess support runs such hooks in the child (PyOS_AfterFork_Child).
_FORK_HOOK_PROBE = """
import asyncio, os, sys, uvloop
from worker_hooks.sglang.launcher import ServerProcess
marker = sys.argv[1]
os.register_at_fork(after_in_child=lambda: open(marker, "a").write("after-fork hook ran in the child\\n"))
async def main():
    exits = []
    server = ServerProcess([sys.executable, "-c", "import sys; sys.exit(3)"], on_start=lambda pid: None,
                           on_exit=exits.append, restart=False)
    await asyncio.wait_for(server.run(), 60)
    print("returncode", exits[0].returncode)
uvloop.run(main())
"""


def test_the_launcher_starts_a_server_without_running_python_in_the_forked_child(tmp_path: Path) -> None:
    marker = tmp_path / "hook-ran"
    out = subprocess.run(
        [sys.executable, "-c", _FORK_HOOK_PROBE, str(marker)],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "returncode 3" in out.stdout.splitlines()  # the exit was watched, with its return code
    assert not marker.exists(), marker.read_text()


async def test_the_exit_watcher_reports_a_kill_at_once() -> None:
    from worker_hooks.sglang.launcher import spawn_child

    child = spawn_child([sys.executable, "-c", "import time; time.sleep(60)"], env=None, output=2)
    try:
        waiting = asyncio.create_task(child.wait())
        await asyncio.sleep(0.2)
        assert not waiting.done() and child.returncode is None
        os.killpg(child.pid, signal.SIGKILL)
        assert await asyncio.wait_for(waiting, 5) == -signal.SIGKILL
        assert await child.wait() == -signal.SIGKILL  # a second wait returns the same at once
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)


def test_the_agent_passes_the_gateways_page_size_unless_the_launch_arguments_give_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from worker_hooks.sglang.__main__ import configure

    monkeypatch.setenv(LAUNCHER_ENV, "python -m tests.e2e.sglang_launch_shim")
    monkeypatch.setenv("LUMEN_CONTROL_TOKEN", "a-control-token-for-the-test")
    base = ["--url", URL, "--gateway", "g:1", "--launch"]
    cfg, launch = configure(*parse([*base, "--", "--model-path", "m"]))
    assert launch is not None and launch[launch.index("--page-size") + 1] == "64" and cfg.page_size == 64
    cfg, launch = configure(*parse([*base, "--page-size", "16", "--", "--model-path", "m"]))
    assert launch is not None and launch[launch.index("--page-size") + 1] == "16" and cfg.page_size == 16
    cfg, launch = configure(*parse([*base, "--", "--page-size", "1"]))  # the launch arguments' own
    assert launch is not None and launch.count("--page-size") == 1 and cfg.page_size == 1
    cfg, launch = configure(*parse([*base, "--page-size", "0", "--", "--model-path", "m"]))
    assert launch is not None and "--page-size" not in launch and cfg.page_size == 0  # SGLang's own
    cfg, launch = configure(*parse(["--url", URL, "--gateway", "g:1"]))  # a server started elsewhere
    assert launch is None and cfg.page_size == 0


def test_a_cpu_server_launched_by_the_agent_gets_sglangs_cpu_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--device cpu` in the launch arguments: SGLANG_USE_CPU_ENGINE and the common_ops stand-in reach
    the server's environment (not the agent's own), and no --enable-deterministic-inference (refused on
    CPU); on a GPU server neither is set."""
    from worker_hooks.sglang.__main__ import GRPC_FORK_ENV, configure, server_environment
    from worker_hooks.sglang.agent import Sidecar
    from worker_hooks.sglang.launcher import CPU_SHIM_DIR

    monkeypatch.setenv(LAUNCHER_ENV, "python -m tests.e2e.sglang_launch_shim")
    monkeypatch.setenv("LUMEN_CONTROL_TOKEN", "a-control-token-for-the-test")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    for device, cpu in (("cpu", True), ("cuda", False)):
        cfg, launch = configure(
            *parse(["--url", URL, "--gateway", "g:1", "--launch", "--", "--device", device])
        )
        assert launch is not None and ("--enable-deterministic-inference" in launch) is not cpu
        sidecar = Sidecar(cfg, launch=launch, launch_env=server_environment())
        try:
            assert sidecar.server is not None and sidecar.server.env is not None
            env = sidecar.server.env
            assert env.get("SGLANG_USE_CPU_ENGINE") == ("1" if cpu else None)
            path = env["PYTHONPATH"].split(os.pathsep)
            assert path == ([CPU_SHIM_DIR, "/elsewhere"] if cpu else ["/elsewhere"])
            assert "LUMEN_PLANE_FILE" in env
            assert env.get(GRPC_FORK_ENV) == os.environ.get(GRPC_FORK_ENV) or GRPC_FORK_ENV not in env
        finally:
            sidecar.planes.close()
    assert "SGLANG_USE_CPU_ENGINE" not in os.environ


# -- `lumen cluster up --engine sglang` on CPU ---------------------------------------------------------


def test_cluster_up_on_cpu_runs_without_gpus_and_groups_none(monkeypatch: pytest.MonkeyPatch) -> None:
    """`-- --device cpu`: no GPU needed (none visible, or some visible and left alone), as many servers
    as asked; without it and without GPUs, exit 2 saying how to run on CPU."""
    from gateway.cli import cluster as cli

    monkeypatch.delenv(LAUNCHER_ENV, raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "sglang" else None)
    monkeypatch.setattr(shutil, "which", lambda *a, **k: None)  # no nvidia-smi
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def ns(*tail: str) -> argparse.Namespace:
        return argparse.Namespace(model="/m", tp=None, workers=2, tail=list(tail))

    launch = cli._sglang_launch(ns("--device", "cpu", "--dtype", "float32"))
    assert launch.gpus is None and launch.workers == 2 and launch.on_cpu
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # one GPU visible: CPU servers do not need two
    assert cli._sglang_launch(ns("--device=cpu")).gpus is None
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with pytest.raises(SystemExit) as exc:
        cli._sglang_launch(ns())
    assert exc.value.code == 2


def test_on_cpu_the_servers_run_without_hicache_and_the_log_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """SGLang 0.5.23's HiCache host pool registers its memory with CUDA, so a CPU server with the
    storage backend's flags dies at start-up: on CPU they are not added (failover is replay)."""
    ckpt = Checkpoints(budget_bytes=8 << 30, page_size=64)
    launch = SGLangLaunch(model="m", workers=2, extra=("--device", "cpu"))
    specs = agent_specs(launch, "h:1", checkpoints=ckpt, default_workers=7, page_size=16)
    for spec in specs:
        tail = server_tail(spec)
        assert tail == ["--model-path", "m", "--tp-size", "1", "--device", "cpu"]
        assert not any(a.startswith("--hicache") or a == "--enable-hierarchical-cache" for a in spec.argv)
        agent = list(spec.argv[: spec.argv.index("--")])
        assert agent[agent.index("--page-size") + 1] == "16"  # the agent passes it to its server
    out = capsys.readouterr()
    assert "sglang_checkpoints_off_on_cpu" in out.out + out.err


def test_the_default_holder_budget_is_sized_from_the_machine() -> None:
    from gateway.config.sections import GiB, machine_holder_budget

    assert machine_holder_budget(24 * GiB) == 6 * GiB
    assert machine_holder_budget(1024 * GiB) == 64 * GiB
    assert machine_holder_budget(0) == 64 * GiB  # not known
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    budget = load_config().checkpoint.budget_bytes
    assert budget == min(64 * GiB, physical // 4) or budget == machine_holder_budget(physical)
    assert budget <= physical // 4


@pytest.mark.parametrize(("poll_s", "misses"), [(0.1, 5), (0.2, 25)])
async def test_the_agent_sees_its_server_ready_whatever_poll_window_it_is_given(
    poll_s: float, misses: int
) -> None:
    """`--poll-ms 200 --poll-misses 25` (a 5 s window, past the detector's default 3 s cap on silence):
    the poll task built a rule that refused itself, died unobserved, and the agent never saw its
    server ready (seen against real servers)."""
    from worker_hooks.sglang.agent import Sidecar
    from worker_hooks.sglang.agent_config import SidecarConfig
    from worker_hooks.sglang.server_http import Probe

    cfg = SidecarConfig(
        worker_id="sg0", url=URL, gateways=("g:1",), poll_interval_s=poll_s, poll_misses=misses
    )
    sidecar = Sidecar(cfg)

    async def ready(timeout_s: float) -> Probe:
        return Probe.READY

    async def loads(timeout_s: float) -> None:
        return None

    sidecar.http.ready = ready  # type: ignore[method-assign]
    sidecar.http.loads = loads  # type: ignore[method-assign]
    poll = asyncio.create_task(sidecar._poll())
    try:
        await sidecar.wait_event(lambda ev: ev["event"] == "server_ready", 5)
        assert sidecar.up and not poll.done()
    finally:
        poll.cancel()
        await asyncio.gather(poll, return_exceptions=True)
        sidecar.planes.close()
