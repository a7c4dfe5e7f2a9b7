"""How SGLang servers are launched: the flags Lumen adds, the testing hook, GPU groups per server."""

from __future__ import annotations

import sys

import pytest

from gateway.cluster.sglang import SGLangLaunch, agent_specs, gpu_groups
from worker_hooks.sglang.launcher import (
    LAUNCHER_ENV,
    LaunchError,
    launcher_prefix,
    server_args,
    server_command,
    sglang_installed,
)

URL = "http://127.0.0.1:30000"


def test_the_flags_lumen_needs_are_added_when_missing() -> None:
    assert server_args(URL, ["--model-path", "m"]) == [
        "--model-path", "m", "--host", "127.0.0.1", "--port", "30000",
        "--sampling-backend", "pytorch", "--enable-deterministic-inference",
    ]  # fmt: skip


def test_flags_already_given_are_kept_once() -> None:
    args = ["--port=30000", "--host", "127.0.0.1", "--sampling-backend", "pytorch"]
    assert server_args(URL, [*args, "--enable-deterministic-inference"]) == [
        *args,
        "--enable-deterministic-inference",
    ]


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
